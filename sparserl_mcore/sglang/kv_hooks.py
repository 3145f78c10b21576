"""The plugin's KV hooks on sglang 0.5.23 (compression and KV figures), and the per-process state
they share.

Always (any KV method, "none" included): the KV figures of every request (`kv_report`), written
AFTER `ScheduleBatch.prepare_for_extend` (prefill: the prompt's positions) and at the end of the
BEFORE hook on `prepare_for_decode` (after any compression), into the request's
`customized_info`, which SGLang returns in the response's meta_info.

One compressed decode step (page size 1, no overlap scheduling, no speculative decoding):
1. BEFORE `managers/schedule_batch.py: ScheduleBatch.prepare_for_decode`: every request of the
   batch holds the KV of all its tokens (the last forward wrote it). Each request whose cache
   reached the budget is compressed (`kv_compaction.SGLangCompactor`, the embedded engine's rule);
   its entries of `seq_lens`, `seq_lens_cpu` and `orig_seq_lens` shrink to its kept entries, so
   SGLang's own `alloc_for_decode` puts the next token's slot right after them.
2. AFTER `model_executor/forward_batch_info.py: ForwardBatch.init_new`: SGLang computed the decode
   positions from the (compacted) `seq_lens`; the positions each row evicted are added back, so
   RoPE sees the token's true position. Under CUDA graphs the replay copies these positions in.
3. AROUND `layers/radix_attention.py: RadixAttention.forward` (only for policies that score with
   the window queries): each decode query, and the last `window` queries of each request's
   prefill (the columns set by the AFTER hook on `ForwardBatch.init_new`), is written into a ring
   of the last `window` queries per request row and layer. A replayed CUDA graph skips this
   Python code, so the launcher disables decode and prefill CUDA graphs for these policies.
4. AFTER `mem_cache/memory_pool.py: ReqToTokenPool.alloc_rows`: a row taken by a new (or
   re-admitted) request starts with nothing evicted and an empty query ring.
5. AFTER `model_executor/model_runner.py: ModelRunner.initialize` (only with a query ring): the
   ring is allocated for `max_running_requests + 1` rows (SGLang's request pool never has more:
   `mem_cache/kv_cache_configurator.py: resolve_max_num_reqs`, `ReqToTokenPool(size)`) right after
   the model is loaded, inside `ModelRunner.__init__`. SGLang measures the free device memory for
   its KV pool later (`TpModelWorker.alloc_memory_pool` -> `KVCacheConfigurator.configure` ->
   `_profile_available_bytes`), so the pool is sized around the ring, not over it.
6. AFTER `managers/schedule_batch.py: ScheduleBatch._get_decode_retraction_order` (a staticmethod,
   which the registry keeps one): under memory pressure SGLang retracts from the end of that order
   (fewest outputs first); compressed requests are moved to the front, so they are retracted only
   when no uncompressed request is left to retract. Retracting one frees at most `budget` slots but
   costs a dense re-prefill of its prompt and output (`reset_for_retract` keeps `output_ids`),
   which is then compressed again at its first decode steps (the embedded engine restarts such a
   request from its prompt instead).
The sampled token and its log-prob come from the forward over the compressed cache.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor, build_compressor
from sparserl_mcore.sglang.kv_compaction import HeadReplicas, SGLangCompactor
from sparserl_mcore.sglang.kv_report import KVReport, slot_bytes

PREPARE_FOR_DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
PREPARE_FOR_EXTEND = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention.forward"
ALLOC_ROWS = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc_rows"
MODEL_INIT = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
RETRACTION_ORDER = "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"

# policies that work inside SGLang; h2o needs the attention mass of every decode step, which the
# attention backends do not expose
SGLANG_METHODS = ("snapkv", "rkv", "streamingllm")


class QueryRing:
    """The last `window` queries of every req_to_token row, per layer: [L, rows, w, Hq, d],
    allocated whole when built (`for_model`, at model load), never inside a forward. A prefill
    (extend) forward writes the last `window` queries of each request's new tokens, a decode forward
    one query per request: the queries the embedded engine keeps (`rollout/engine/batch_forward.py`), so a
    compression right after the prompt scores with the prompt's last queries there and here."""

    def __init__(
        self, *, layers: int, start_layer: int, rows: int, window: int, q_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.layers, self.rows, self.window, self.start_layer = layers, rows, window, start_layer
        self.q_heads, self.head_dim = q_heads, head_dim
        self.buf = torch.zeros((layers, rows, window, q_heads, head_dim), dtype=dtype, device=device)
        self.seen = torch.zeros(rows, dtype=torch.int64, device=device)
        self._rows: torch.Tensor | None = None
        self._cols: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None  # extend: which of the forward's queries go in

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, rows: int, window: int, dtype: torch.dtype) -> QueryRing:
        """A ring for this TP / PP rank's attention layers (SGLang's `RadixAttention` modules)."""
        from sglang.srt.layers.radix_attention import RadixAttention

        attn = [m for m in model.modules() if isinstance(m, RadixAttention)]
        if not attn:
            raise SystemExit("sparserl plugin: the model has no RadixAttention layer to capture queries from")
        ids = sorted(m.layer_id for m in attn)
        heads, dims = {m.tp_q_head_num for m in attn}, {m.head_dim for m in attn}
        if len(heads) != 1 or len(dims) != 1 or ids != list(range(ids[0], ids[0] + len(ids))):
            raise SystemExit(
                f"sparserl plugin: attention layers {ids[:4]}... with query heads {heads} and head dims "
                f"{dims}: the query ring needs uniform, consecutive layers"
            )
        device = next(iter(model.parameters()), torch.empty(0)).device  # where the model runs
        return cls(
            layers=len(ids), start_layer=ids[0], rows=rows, window=window, q_heads=heads.pop(),
            head_dim=dims.pop(), dtype=dtype, device=device,
        )  # fmt: skip

    def describe(self) -> str:
        size = self.buf.numel() * self.buf.element_size()
        return (
            f"{size / 2**30:.2f} GiB ({self.layers} layers x {self.rows} rows x window {self.window} x "
            f"{self.q_heads} query heads x {self.head_dim} x {self.buf.dtype})"
        )

    def begin_step(self, rows: torch.Tensor) -> None:
        """A decode forward over `rows` starts: each row writes its next ring column."""
        rows = rows.to(torch.int64)
        self._rows, self._cols, self._tokens = rows, self.seen[rows] % self.window, None
        self.seen[rows] += 1

    def begin_extend(self, rows: Sequence[int], extend_lens: Sequence[int]) -> None:
        """A prefill forward over `rows` starts; its queries are the rows' new tokens back to back
        (`extend_lens` each): the last `window` of each row go into its next ring columns."""
        tokens: list[int] = []
        ring_rows: list[int] = []
        cols: list[int] = []
        start = 0
        for row, n in zip(rows, extend_lens, strict=True):
            take, seen = min(n, self.window), int(self.seen[row])
            tokens += range(start + n - take, start + n)
            ring_rows += [row] * take
            cols += [(seen + j) % self.window for j in range(take)]
            self.seen[row] += take
            start += n
        device = self.seen.device
        self._rows = torch.tensor(ring_rows, dtype=torch.int64, device=device)
        self._cols = torch.tensor(cols, dtype=torch.int64, device=device)
        self._tokens = torch.tensor(tokens, dtype=torch.int64, device=device)

    def record(self, layer_id: int, q: torch.Tensor) -> None:
        if self._rows is None or self._cols is None:
            return
        q = q.reshape(-1, self.q_heads, self.head_dim)
        if self._tokens is not None:
            q = q[self._tokens.to(q.device)]
        self.buf[layer_id - self.start_layer, self._rows, self._cols] = q.to(self.buf.dtype)

    def window_queries(self, row: int) -> torch.Tensor | None:
        """[L * Hq, w', d], oldest first (w' = queries seen, at most window); None before any."""
        seen = min(int(self.seen[row]), self.window)
        if seen == 0:
            return None
        total = int(self.seen[row])
        cols = [(total - seen + j) % self.window for j in range(seen)]
        q = self.buf[:, row, cols]  # [L, w', Hq, d]
        return q.transpose(1, 2).reshape(-1, seen, q.shape[-1])

    def reset_rows(self, rows: list[int]) -> None:
        if rows:
            self.seen[torch.tensor(rows, device=self.seen.device)] = 0


class KVHooks:
    """The hook functions (bound methods) and the state they share in one SGLang scheduler process.
    With method "none" only the KV figures are reported; nothing is compressed."""

    def __init__(self, cfg: KVCompressionConfig, *, max_running_requests: int | None = None) -> None:
        if cfg.enabled and cfg.method not in SGLANG_METHODS:
            raise ValueError(
                f"kv method {cfg.method!r} does not work inside SGLang (choose from {list(SGLANG_METHODS)}): "
                "h2o needs per-step attention mass that SGLang's attention backends do not return"
            )
        compressor = build_compressor(cfg) if cfg.enabled else None
        if (
            compressor is not None
            and compressor.needs_window_queries
            and (max_running_requests is None or max_running_requests < 1)
        ):
            raise ValueError(
                f"max_running_requests={max_running_requests}: {cfg.method} keeps a query ring per "
                "request row, sized from SGLang's --max-running-requests (sparserl sglang-serve passes both)"
            )
        self.cfg, self.max_running_requests = cfg, max_running_requests
        self.compressor: KVCompressor | None = compressor
        self.compactor: SGLangCompactor | None = None
        self.ring: QueryRing | None = None
        self.total_kv_heads: int | None = None  # the model's, read at model load (ring policies)
        self.report: KVReport | None = None

    def targets(self) -> list[tuple[str, str]]:
        """(dotted path, hook type name) of every hook this configuration needs."""
        hooks = [(PREPARE_FOR_EXTEND, "AFTER"), (PREPARE_FOR_DECODE, "BEFORE")]
        if self.compressor is not None:
            hooks += [(INIT_NEW, "AFTER"), (ALLOC_ROWS, "AFTER"), (RETRACTION_ORDER, "AFTER")]
            if self.compressor.needs_window_queries:
                hooks += [(ATTENTION, "AROUND"), (MODEL_INIT, "AFTER")]
        return hooks

    def hook(self, target: str) -> Any:
        return {
            PREPARE_FOR_EXTEND: self.after_prepare_for_extend,
            PREPARE_FOR_DECODE: self.before_prepare_for_decode,
            INIT_NEW: self.after_init_new,
            ALLOC_ROWS: self.after_alloc_rows,
            ATTENTION: self.around_attention,
            MODEL_INIT: self.after_model_init,
            RETRACTION_ORDER: self.after_retraction_order,
        }[target]

    def after_model_init(self, result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        """The query ring, right after the model is loaded and before SGLang sizes its KV pool."""
        rows = self.max_running_requests
        if (
            rows is None
            or self.compressor is None
            or not self.compressor.needs_window_queries
            or getattr(runner, "is_draft_worker", False)
        ):
            return
        self.ring = QueryRing.for_model(
            runner.model, rows=rows + 1, window=self.cfg.window, dtype=runner.dtype
        )
        self.total_kv_heads = runner.model_config.get_total_num_kv_heads()
        print(
            f"sparserl plugin: {self.cfg.method} query ring {self.ring.describe()}, allocated before "
            "SGLang sizes its KV pool",
            file=sys.stderr,
            flush=True,
        )

    def _report(self, batch: Any) -> KVReport:
        if self.report is None:
            from sglang.srt.runtime_context import get_parallel

            pool = batch.token_to_kv_pool_allocator.get_kvcache()
            self.report = KVReport(slot_bytes(pool, get_parallel().tp_size))
        return self.report

    def _bind(self, batch: Any) -> SGLangCompactor | None:
        """Build the compression state on the first decode batch (the pools exist only then) and
        refuse what cannot work: checked once, on the objects SGLang really uses."""
        if self.compactor is None and self.compressor is not None:
            if not batch.spec_algorithm.is_none():
                raise SystemExit("sparserl plugin: KV compression does not support speculative decoding")
            if batch.enable_overlap:
                raise SystemExit("sparserl plugin: KV compression needs --disable-overlap-schedule")
            try:
                self.compactor = SGLangCompactor(self.cfg, self.compressor, batch.tree_cache, self._heads())
            except ValueError as exc:
                raise SystemExit(f"sparserl plugin: {exc}") from None
            if self.compressor.needs_window_queries:
                _check_ring(self.ring, self.compactor.req_to_token.shape[0], self.max_running_requests)
        return self.compactor

    def _heads(self) -> HeadReplicas:
        """This rank's heads in SGLang's TP group (`runtime_context.get_parallel`); only the
        policies scoring with queries need the group (KV heads replicated over TP ranks)."""
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        if self.total_kv_heads is None or par.tp_size == 1:
            return HeadReplicas()
        return HeadReplicas.of(
            rank=par.tp_rank, size=par.tp_size, total_kv_heads=self.total_kv_heads,
            group=par.tp_group.device_group,
        )  # fmt: skip

    def after_prepare_for_extend(self, result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        """Prefill: each request's forward attends over its whole (extended) sequence."""
        report = self._report(batch)
        for req, length in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True):
            report.record(req, int(length))

    def before_prepare_for_decode(self, batch: Any, *args: Any, **kwargs: Any) -> None:
        """Compress the due requests and shrink their kv lengths before SGLang allocates the next
        slot; then report what each request's decode forward will attend over."""
        compactor = self._bind(batch)
        shrink = self._compress_due(batch, compactor) if compactor is not None else [0] * len(batch.reqs)
        if any(shrink):
            delta = torch.tensor(shrink, dtype=batch.seq_lens_cpu.dtype)
            batch.seq_lens_cpu = batch.seq_lens_cpu - delta
            batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
            if batch.orig_seq_lens is not None:
                batch.orig_seq_lens = batch.orig_seq_lens - delta.to(
                    batch.orig_seq_lens.device, batch.orig_seq_lens.dtype
                )
        report = self._report(batch)
        for req, length, freed in zip(batch.reqs, batch.seq_lens_cpu.tolist(), shrink, strict=True):
            report.record(req, int(length) + 1, evicted=freed)  # + the slot this step appends

    def _compress_due(self, batch: Any, compactor: SGLangCompactor) -> list[int]:
        """Compress each due request of the batch; the positions each one freed."""
        shrink = [0] * len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            if not compactor.due(req):
                continue
            queries = None
            if self.ring is not None:
                queries = self.ring.window_queries(req.kv.req_pool_idx)
                if queries is None:  # no decode query yet (a prompt above the budget): next step
                    continue
            before = req.kv.kv_committed_len
            # leave one free slot per request for SGLang's own decode allocation right after this
            shrink[i] = before - compactor.compress(req, queries, reserve=len(batch.reqs)).kv_len
        return shrink

    def after_init_new(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Decode positions = SGLang's (kv length - 1) + what the row evicted; the query ring's
        columns for this forward (decode, or a prefill's last `window` queries per request)."""
        mode = forward_batch.forward_mode
        rows = forward_batch.req_pool_indices.to(torch.int64)
        if mode.is_decode():
            if self.compactor is not None:
                offset = self.compactor.evicted[rows].to(
                    forward_batch.positions.device, forward_batch.positions.dtype
                )
                forward_batch.positions = forward_batch.positions + offset
            if self.ring is not None:
                self.ring.begin_step(rows)
        elif self.ring is not None and mode.is_extend():
            self.ring.begin_extend(rows.tolist(), list(forward_batch.extend_seq_lens_cpu))
        return forward_batch

    def after_retraction_order(
        self, order: list[int], reqs: Any, *args: Any, **kwargs: Any
    ) -> list[int] | None:
        """SGLang's order (most preferred to keep first) with the compressed requests first, each
        group in SGLang's own order; None (SGLang's order) when none is compressed."""
        if self.compactor is None:
            return None
        compressed = [i for i in order if self.compactor.compressed(reqs[i])]
        if not compressed:
            return None
        return compressed + [i for i in order if i not in set(compressed)]

    def after_alloc_rows(self, rows: list[int] | None, *args: Any, **kwargs: Any) -> None:
        if rows and self.compactor is not None:
            self.compactor.reset_rows(rows)
        if rows and self.ring is not None:
            self.ring.reset_rows(rows)

    def around_attention(
        self, original: Any, layer: Any, q: Any, k: Any, v: Any, forward_batch: Any, *args: Any, **kwargs: Any
    ) -> Any:
        mode = forward_batch.forward_mode
        if self.ring is not None and (mode.is_decode() or mode.is_extend()):
            self.ring.record(layer.layer_id, q)
        return original(layer, q, k, v, forward_batch, *args, **kwargs)


def _check_ring(ring: QueryRing | None, pool_rows: int, max_running_requests: int | None) -> None:
    """The ring built at model load must cover every row of SGLang's request pool."""
    if ring is None:
        raise SystemExit(
            "sparserl plugin: no query ring was allocated at model load (ModelRunner.initialize was not "
            "hooked); start the server with sparserl sglang-serve"
        )
    if pool_rows > ring.rows:
        raise SystemExit(
            f"sparserl plugin: SGLang's request pool has {pool_rows} rows but the query ring has "
            f"{ring.rows} (max_running_requests {max_running_requests} + 1): start the server with "
            "sparserl sglang-serve --max-running-requests, which passes the same number to SGLang"
        )
