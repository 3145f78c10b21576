"""Pure-decode steps as one static, device-only step: replayed as a CUDA graph on CUDA.

Why: a decode step of the eager path dispatches ~45 ops per layer (1,086 at 24 layers) and builds
its page tables and masks from host lists, so at rollout batch sizes an H100 waits on the host
(../docs/rollout.md, "Decode graphs"). Here the step's inputs live in static device buffers that
one host->device copy fills, and `decode_step` reads only them: no host sync, no shape that
depends on the batch's contents, so CUDA can capture it once per (batch bucket, context bucket)
and replay it. On the CPU the same step runs eagerly (the tests' path and the exactness oracle's
counterpart: it must equal `BatchForward`'s gather path on every live row).

Which steps: decodes only (no prefill in the step), a dense model (the MoE forward picks experts on
the host), and a compressor that needs neither attention mass (H2O) nor window queries (SnapKV,
R-KV); everything else stays on the eager path. Padded rows of a bucket read and write one
reserved scratch page of the pool (`KVPool.reserve`), so live pages are never touched by them.

Shape legend: M the bucket's rows (>= live requests B), P pages per row (context bucket / page
size), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sparserl_mcore.rollout.engine.hf_model import CausalLM
from sparserl_mcore.rollout.engine.host_ints import long_tensor
from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention
from sparserl_mcore.rollout.engine.request_state import RequestState


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 16 up to `max_bs` (SGLang's and nano-vllm's
    shape: a step pads to the next bucket, so few graphs cover every batch)."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return [*small, *range(16, max_bs, 16), max_bs]


def context_buckets(page_size: int, max_context: int) -> list[int]:
    """Context widths (entries, whole pages): 256 doubling up to `max_context` (rounded up to pages).
    The gather reads a row's pages up to its bucket's width, so short rollouts read little."""
    top = -(-max_context // page_size) * page_size
    widths, width = [], -(-256 // page_size) * page_size
    while width < top:
        widths.append(width)
        width *= 2
    return [*widths, top]


class DecodeGraphs:
    """Static decode buffers over `pool`, one step per (batch, context) bucket.

    `covers(decodes)` says whether a step can run here; `__call__(decodes)` fills the buffers with
    one copy and returns the live rows' fp32 logits [B, V]. `capture()` (CUDA only) records every
    bucket's step into one shared memory pool, largest first, so later (smaller) graphs reuse the
    largest one's blocks. Weight updates must write parameters in place (`CausalLM.update` and the
    patch receiver do): graphs hold their addresses.
    """

    def __init__(
        self, model: CausalLM, pool: KVPool, *, max_bs: int, max_context: int, triton_decode: bool = False
    ) -> None:
        if max_bs < 1 or max_context < 1:
            raise ValueError(f"max_bs={max_bs}, max_context={max_context}: both must be >= 1")
        self.model, self.pool, self.max_bs = model, pool, max_bs
        self.triton_decode = triton_decode  # attention by the Triton kernel, not the gather path
        ps, dev = pool.page_size, pool.k.device
        self.batches = batch_buckets(max_bs)
        self.widths = context_buckets(ps, max_context)
        self.max_pages = self.widths[-1] // ps
        model.reserve_rope(self.widths[-1] + 1)
        (self.scratch,) = pool.reserve(1)
        # per bucket of M rows: ids, positions, write slots, lengths [M] each, then page tables
        # [M, P] (P = the bucket's pages per row), contiguous: one copy fills a step's inputs
        size = max_bs * (4 + self.max_pages)
        self._inputs = torch.zeros(size, dtype=torch.int64, device=dev)
        # the host side of the inputs: pinned staging on CUDA, the inputs themselves on the CPU
        self._host = torch.empty(size, dtype=torch.int64).pin_memory() if dev.type == "cuda" else self._inputs
        # Every row's page table kept between steps: a row is rewritten only when its request's
        # pages (a list replaced, never modified, by its owners) or their count in use changed,
        # i.e. on a new page or a new request in that row, not on each of a page's tokens.
        self._tables = torch.full((max_bs, self.max_pages), self.scratch, dtype=torch.int64)
        self._row_pages: list[list[int] | None] = [None] * max_bs
        self._row_used = [0] * max_bs
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}

    def covers(self, decodes: Sequence[RequestState]) -> bool:
        """True when these decodes fit a bucket (batch and longest context after this step)."""
        return 0 < len(decodes) <= self.max_bs and max(r.n_cached + 1 for r in decodes) <= self.widths[-1]

    def bucket(self, decodes: Sequence[RequestState]) -> tuple[int, int]:
        """(rows M, context width N) of the smallest bucket holding `decodes`."""
        longest = max(r.n_cached + 1 for r in decodes)
        rows = next(b for b in self.batches if b >= len(decodes))
        width = next(w for w in self.widths if w >= longest)
        return rows, width

    def __call__(self, decodes: Sequence[RequestState]) -> torch.Tensor:
        """Logits [B, V] of one decode step of `decodes` (KV written into the pool)."""
        key = self.prepare(decodes)
        graph = self._graphs.get(key)
        if graph is None:
            logits = self.decode_step(*key)
        else:
            graph.replay()
            logits = self._outputs[key]
        return logits[: len(decodes)]

    def prepare(self, decodes: Sequence[RequestState]) -> tuple[int, int]:
        """Fill the static inputs for `decodes` (padded rows: token 0 at position 0, writing and
        reading the scratch page); returns the bucket. Host work plus ONE host->device copy."""
        rows, width = self.bucket(decodes)
        ps, pad, n_pages = self.pool.page_size, rows - len(decodes), width // self.pool.page_size
        ids = [r.output_ids[-1] for r in decodes] + [0] * pad
        pos = [r.next_pos for r in decodes] + [0] * pad
        write = [r.pages[r.n_cached // ps] * ps + r.n_cached % ps for r in decodes]
        write += [self.scratch * ps] * pad
        lengths = [r.n_cached + 1 for r in decodes] + [1] * pad
        for row, r in enumerate(decodes):
            self._set_row(row, r.pages, -(-(r.n_cached + 1) // ps))
        for row in range(len(decodes), rows):
            self._set_row(row, None, 0)
        head = 4 * rows
        self._host[:head].copy_(long_tensor(ids + pos + write + lengths, torch.device("cpu")))
        n = head + rows * n_pages
        self._host[head:n].view(rows, n_pages).copy_(self._tables[:rows, :n_pages])
        if self._host is not self._inputs:  # one asynchronous copy: the host never waits for the device
            self._inputs[:n].copy_(self._host[:n], non_blocking=True)
        return rows, width

    def _set_row(self, row: int, pages: list[int] | None, used: int) -> None:
        """Row `row` of the page tables: pages[:used], then the scratch page (None: all scratch)."""
        if self._row_pages[row] is pages and self._row_used[row] == used:
            return
        old = self._row_used[row]
        if used:
            assert pages is not None
            self._tables[row, :used] = long_tensor(pages[:used], torch.device("cpu"))
        if old > used:
            self._tables[row, used:old] = self.scratch
        self._row_pages[row], self._row_used[row] = pages, used

    def decode_step(self, rows: int, width: int) -> torch.Tensor:
        """The captured region: logits [M, V] from the static inputs, device ops only.

        Every shape here is fixed by (rows, width); nothing reads a value back to the host."""
        model, pool = self.model, self.pool
        ps, n_pages = pool.page_size, width // pool.page_size
        ids, pos, write, lengths = (self._inputs[i * rows : (i + 1) * rows] for i in range(4))
        pages = self._inputs[4 * rows : rows * (4 + n_pages)]  # [M * P], row-major
        valid = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]
        bias = torch.where(valid, 0.0, -math.inf).to(pool.k.dtype)[:, None, None, :]
        layout = DecodeLayout(pages=pages, lengths=lengths, page_size=ps, valid=valid, bias=bias)
        cos, sin = model.rope_at(pos)
        h = model.embed(ids)
        for layer in range(model.cfg.num_layers):
            q, k, v = model.qkv(layer, h, cos, sin)
            pool.k_flat(layer).index_copy_(0, write, k)
            pool.v_flat(layer).index_copy_(0, write, v)
            k_rows, v_rows, triton = pool.k_rows(layer), pool.v_rows(layer), self.triton_decode
            out, _ = decode_attention(q, k_rows, v_rows, layout, use_native=False, use_triton=triton)
            h = model.finish_layer(layer, h, out)
        return model.logits(h)

    def capture(self) -> None:
        """Record every bucket's step as a CUDA graph (largest first, one shared memory pool)."""
        if self.pool.k.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; on the CPU the static step runs eagerly")
        mem_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for key in sorted(((b, w) for b in self.batches for w in self.widths), reverse=True):
                self.decode_step(*key)  # warm-up: kernels chosen, workspaces allocated
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mem_pool, stream=stream):
                    self._outputs[key] = self.decode_step(*key)
                self._graphs[key] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
