"""One mixed prefill + decode forward over the paged pool (the model side of a scheduler step).

The linear layers see every new token of the step at once: one token of each decoding request and
the uncached prompt tail of each newly admitted one. Attention runs batched over pages for the
decodes and per prompt for the prefills. Besides the logits, the forward feeds what compression
needs: the window queries (SnapKV, R-KV) and the attention mass (H2O) of every request, stored in
its lane of `CompressionLanes` with one indexed write per step. A step holding a request that
asked for its routed experts records every MoE layer's choices (`CausalLM.record_routing`, rows in
the step's order: decodes, then each prefill's new tokens) and hands each request its rows.
"""

from __future__ import annotations

import itertools

import torch

from sparserl_mcore.rollout.engine.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.engine.decode_graphs import DecodeGraphs
from sparserl_mcore.rollout.engine.hf_model import CausalLM
from sparserl_mcore.rollout.engine.host_ints import long_tensor
from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.paged_attention import (
    CROSS_HEAD_MAX_KV_HEADS,
    DecodeLayout,
    decode_attention,
    native_decode_kernel,
    prefill_attention,
)
from sparserl_mcore.rollout.engine.request_state import RequestState
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor


class BatchForward:
    """The forward of a scheduler step; advances each request's cache counters."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        kv_cfg: KVCompressionConfig,
        compressor: KVCompressor | None,
        lanes: CompressionLanes | None,
        graphs: DecodeGraphs | None = None,
        triton_decode: bool = False,
    ) -> None:
        self.model, self.pool, self.kv_cfg, self.lanes = model, pool, kv_cfg, lanes
        self.triton_decode = triton_decode  # decode attention by the Triton kernel where no mass is wanted
        self.want_mass = compressor is not None and compressor.needs_accumulated_attention
        self.want_queries = compressor is not None and compressor.needs_window_queries
        # the static decode step serves pure-decode steps that feed compression nothing
        self.graphs = None if self.want_mass or self.want_queries else graphs
        self.static_steps = 0  # steps the static decode step (a graph replay on CUDA) ran

    def __call__(self, decodes: list[RequestState], prefills: list[RequestState]) -> torch.Tensor:
        """One mixed forward; writes the new K/V into the pool; returns logits [B, V] (decodes first)."""
        if not prefills and self.graphs is not None and self.graphs.covers(decodes):
            logits = self.graphs(decodes)
            self.static_steps += 1
            self._after_forward(decodes, [], [], None)
            return logits
        model = self.model
        if model.cfg.moe is not None and any(r.req.return_routed_experts for r in (*decodes, *prefills)):
            outer = model.routing_sink  # a caller's own recording (bench_moe_mismatch) keeps its rows
            fed = [1] * len(decodes) + [len(r.req.input_ids) - r.n_cached for r in prefills]
            sink: list[list[torch.Tensor]] = []
            model.record_routing(sink)
            try:
                logits = self._forward(decodes, prefills)
            finally:
                model.record_routing(outer)
            if outer is not None:
                outer.extend(sink)
            self._hand_out_routing([*decodes, *prefills], fed, sink)
            return logits
        return self._forward(decodes, prefills)

    def _forward(self, decodes: list[RequestState], prefills: list[RequestState]) -> torch.Tensor:
        dev, model, ps = self.pool.k.device, self.model, self.pool.page_size
        # token ids, RoPE positions and pool slots of every new token, as Python ints: one tensor
        ids, pos, write, prefill_tokens = [], [], [], []
        for r in decodes:
            ids.append(r.output_ids[-1])
            pos.append(r.next_pos)
            write.append(r.pages[r.n_cached // ps] * ps + r.n_cached % ps)
        for r in prefills:
            n = len(r.req.input_ids)
            ids.extend(r.req.input_ids[r.n_cached :])
            pos.extend(range(r.n_cached, n))
            write.extend(r.pages[i // ps] * ps + i % ps for i in range(r.n_cached, n))
            prefill_tokens.append(n - r.n_cached)
        ids_t, pos_t, write_t = long_tensor(ids + pos + write, dev).view(3, -1)
        cos, sin = model.rope(pos_t, max(pos) + 1)
        n_dec = len(decodes)
        layout = self._decode_layout(decodes) if decodes else None
        ends = list(itertools.accumulate(prefill_tokens))
        starts = [0, *ends[:-1]] if ends else []
        want_mass, want_queries = self.want_mass, self.want_queries
        # decode-only steps (most steps): the window rows are all rows, a slice of q, no gather
        window_rows = self._window_rows(n_dec, prefill_tokens) if want_queries and prefills else None
        q_rows: list[torch.Tensor] = []
        masses: list[list[torch.Tensor | None]] = []
        h = model.embed(ids_t)
        for layer in range(model.cfg.num_layers):
            q, k, v = model.qkv(layer, h, cos, sin)
            kf, vf = self.pool.k_flat(layer), self.pool.v_flat(layer)
            kf.index_copy_(0, write_t, k)
            vf.index_copy_(0, write_t, v)
            outs: list[torch.Tensor] = []
            layer_mass: list[torch.Tensor | None] = []
            if layout is not None:
                out, mass = decode_attention(
                    q[:n_dec],
                    self.pool.k_rows(layer),
                    self.pool.v_rows(layer),
                    layout,
                    want_mass=want_mass,
                    use_triton=self.triton_decode,
                )
                outs.append(out)
                layer_mass.append(mass)
            for r, start, end in zip(prefills, starts, ends, strict=True):
                sl = r.slot_table(self.pool)[: len(r.req.input_ids)]
                out, mass = prefill_attention(q[n_dec + start : n_dec + end], kf, vf, sl, want_mass=want_mass)
                outs.append(out)
                layer_mass.append(mass)
            if want_queries:
                q_rows.append(q[:n_dec] if window_rows is None else q.index_select(0, window_rows))
            masses.append(layer_mass)
            h = model.finish_layer(layer, h, outs[0] if len(outs) == 1 else torch.cat(outs))
        self._after_forward(decodes, prefills, q_rows, masses if want_mass else None)
        if prefills:  # only each prompt's last position samples
            last = list(range(n_dec)) + [n_dec + e - 1 for e in ends]
            h = h.index_select(0, long_tensor(last, dev))
        return model.logits(h)

    def _hand_out_routing(
        self, batch: list[RequestState], fed: list[int], sink: list[list[torch.Tensor]]
    ) -> None:
        """Give each request that asked its rows of the step's expert ids ([T, L, k], compact)."""
        (layers,) = sink  # one forward
        assert self.model.cfg.moe is not None
        dtype = routing_dtype(self.model.cfg.moe.num_experts)
        ids = torch.stack(layers, dim=1).to(device="cpu", dtype=dtype)
        assert sum(fed) == ids.shape[0], f"{ids.shape[0]} routed rows for {sum(fed)} fed tokens"
        start = 0
        for r, n in zip(batch, fed, strict=True):
            if r.req.return_routed_experts:
                r.routed.append(ids[start : start + n].clone())
            start += n

    def _decode_layout(self, decodes: list[RequestState]) -> DecodeLayout:
        """Page tables padded with page 0 (real, finite, masked) and masks, built once per step and
        shared by every layer's decode attention."""
        ps = self.pool.page_size
        lengths = [r.n_cached + 1 for r in decodes]
        tables = [r.pages[: -(-n // ps)] for r, n in zip(decodes, lengths, strict=True)]
        dtype, device, cfg = self.pool.k.dtype, self.pool.k.device, self.model.cfg
        cross = (
            (cfg.num_heads, cfg.num_kv_heads)
            if self.want_mass
            and cfg.num_kv_heads <= CROSS_HEAD_MAX_KV_HEADS
            and native_decode_kernel(device, dtype) is None  # the kernel returns the mass itself
            else None
        )
        return DecodeLayout.build(
            tables, lengths, page_size=ps, dtype=dtype, device=device, cross_heads=cross
        )

    def _window_rows(self, n_dec: int, prefill_tokens: list[int]) -> torch.Tensor:
        """Rows whose queries enter the observation window: every decode row, each prompt's last w."""
        rows, start, w = list(range(n_dec)), n_dec, self.kv_cfg.window
        for t in prefill_tokens:
            rows.extend(range(start + max(0, t - w), start + t))
            start += t
        return long_tensor(rows, self.pool.k.device)

    def _after_forward(
        self,
        decodes: list[RequestState],
        prefills: list[RequestState],
        q_rows: list[torch.Tensor],
        masses: list[list[torch.Tensor | None]] | None,
    ) -> None:
        """Advance counters; record window queries and (h2o) attention mass, all requests at once."""
        dev, w, lanes = self.pool.k.device, self.kv_cfg.window, self.lanes
        # per layer, masses hold [decode mass [B, Hk, N]] (when decoding) + one [Hk, n] per prefill
        if masses and decodes:  # [L, B, Hk, N], slot order
            assert lanes is not None
            lane_ids = long_tensor([_lane(r) for r in decodes], dev)
            lanes.add_mass(lane_ids, torch.stack([_tensor(m[0]) for m in masses]))
        if q_rows:  # ring rows of the rows of _window_rows: 1 per decode, the last <= w of a prompt
            assert lanes is not None
            rows = [lanes.ring_row(_lane(r), r.q_seen) for r in decodes]
            for r in prefills:
                seen, n_rows = r.q_seen, min(len(r.req.input_ids) - r.n_cached, w)
                rows.extend(lanes.ring_row(_lane(r), seen + j) for j in range(n_rows))
            lanes.push_queries(long_tensor(rows, dev), torch.stack(q_rows))  # [L, rows, Hq, d]
        if not prefills and not q_rows and masses is None:  # pure decode (every static step)
            for r in decodes:
                r.n_cached += 1
                r.next_pos += 1
                r.peak_retained = max(r.peak_retained, r.n_cached)
            return
        for i, r in enumerate(decodes + prefills):
            t = 1 if i < len(decodes) else len(r.req.input_ids) - r.n_cached
            if q_rows:
                r.q_seen += 1 if i < len(decodes) else min(t, w)
            if masses is not None and i >= len(decodes):
                assert lanes is not None and lanes.mass is not None
                prefill_mass = torch.stack([_tensor(m[i - len(decodes) + bool(decodes)]) for m in masses])
                lanes.mass[:, _lane(r), :, : r.n_cached + t] += prefill_mass
            r.n_cached += t
            r.next_pos += t
            r.peak_retained = max(r.peak_retained, r.n_cached)


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of expert ids: int16 up to 32767 experts."""
    return torch.int16 if num_experts <= 2**15 - 1 else torch.int32


def _lane(r: RequestState) -> int:
    assert r.lane is not None, f"request {r.rid} runs without a compression lane"
    return r.lane


def _tensor(x: torch.Tensor | None) -> torch.Tensor:
    assert x is not None, "attention mass was requested but not returned"
    return x
