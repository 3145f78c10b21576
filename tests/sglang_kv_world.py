"""SGLang 0.5.23's real KV pools, allocator, req-to-token map and radix tree on CPU, sized small,
with requests placed through SGLang's own prefix match (shared by the KV compression tests).

Both radix caches are built: 0.5.23's default `UnifiedRadixCache` (what `mem_cache/registry.py:
default_radix_cache_factory` returns, FULL component only for a plain MHA model) and the legacy
`RadixCache`; `CACHES` parametrizes the tests over them."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang_cpu import require_sglang

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, build_compressor
from sparserl_mcore.sglang.kv_hooks import KVHooks

L, HK, HQ, D = 3, 2, 4, 8  # layers, KV heads, query heads (GQA 2), head dim
PROMPT = list(range(100, 110))  # 10 tokens, radix-shared
CFG = dict(budget=24, interval=8, window=4, sink_tokens=2)  # keep_tokens 16
CACHES = ("unified", "legacy")


@pytest.fixture
def sglang_context():
    """SGLang importable, and its runtime context published (its release path reads the serving
    and speculative settings from it), as a server process would have it."""
    require_sglang()
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0))
    yield
    reset_context()


def tree_cache(kind: str, rtp, alloc):
    """The radix cache SGLang 0.5.23 builds for a plain MHA model ("unified", its default) or the
    legacy one, over the given pools."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    if kind == "unified":
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params = CacheInitParams(
            disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1,
            tree_components=(ComponentType.FULL,),
        )  # fmt: skip
        return UnifiedRadixCache(params)
    if kind == "legacy":
        from sglang.srt.mem_cache.radix_cache import RadixCache

        return RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1
            )
        )
    raise ValueError(f"cache kind {kind!r}: one of {CACHES}")


class World:
    """SGLang's real pools and radix tree, sized small, with K/V of every slot a distinct value."""

    def __init__(
        self,
        cache: str = "unified",
        *,
        slots: int = 128,
        rows: int = 4,
        context: int = 64,
        kv_heads: int = HK,
    ) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.kv = MHATokenToKVPool(
            size=slots, page_size=1, dtype=torch.float32, head_num=kv_heads, head_dim=D, layer_num=L,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.alloc = TokenToKVPoolAllocator(
            size=slots, dtype=torch.float32, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.rtp = ReqToTokenPool(size=rows, max_context_len=context, device="cpu", enable_memory_saver=False)
        self.tree = tree_cache(cache, self.rtp, self.alloc)
        gen = torch.Generator().manual_seed(0)
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen))

    def admit(self, rid: str, prompt: list[int]):
        """A request through SGLang's prefix match, its row and its own slots for the unmatched prompt."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4096))
        req.init_next_round_input(self.tree)  # sets prefix_len, last_node and cache_protected_len
        req.lock = self.tree.lock(req.last_node)
        (row,) = self.rtp.alloc([req])
        prefix = self.tree.path_device_indices(req.last_node)
        self.rtp.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(prefix)
        req.extend_end = len(prompt)
        self.grow(req, len(prompt) - len(prefix))
        return req

    def grow(self, req, n: int, tokens: list[int] | None = None) -> torch.Tensor:
        """n more tokens with KV (prefill remainder, or decode steps when `tokens` are outputs);
        their new slots."""
        slots = self.alloc.alloc(n)
        start = req.kv.kv_committed_len
        self.rtp.write((req.kv.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n
        if tokens is not None:
            req.output_ids.extend(tokens)
        return slots.to(torch.int64)

    def row(self, req) -> torch.Tensor:
        return self.rtp.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64).clone()

    def tree_tokens(self) -> int:
        """Tokens the radix tree holds (evictable + locked), for either cache."""
        return int(self.tree.evictable_size()) + int(self.tree.protected_size())


def world_with_shared_prefix(cache: str = "unified", kv_heads: int = HK) -> tuple[World, object, object]:
    """A's 10-token prompt in the radix tree (as after its prefill); B = that prompt + 3 tokens,
    matched through SGLang, then 11 decode steps: 24 entries, exactly the budget."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    w = World(cache, kv_heads=kv_heads)
    a = w.admit("a", PROMPT)
    checkpoint_kv_cache(a, w.tree)  # A's prompt enters the radix tree, as after its prefill
    b = w.admit("b", PROMPT + [7, 8, 9])
    assert b.kv.cache_protected_len == len(PROMPT)  # the radix tree owns the shared prompt
    w.grow(b, 11, tokens=list(range(200, 211)))
    return w, a, b


def compactor(w: World, method: str | KVCompressionConfig):
    """Our compactor on the world's pools, for `method` with the small CFG (or a full config)."""
    from sparserl_mcore.sglang.kv_compaction import SGLangCompactor

    cfg = method if isinstance(method, KVCompressionConfig) else KVCompressionConfig(method=method, **CFG)
    compressor = build_compressor(cfg)
    assert compressor is not None
    return SGLangCompactor(cfg, compressor, w.tree)


class EmbeddedReference:
    """The embedded engine's compaction (`rollout/engine/compaction.py: Compactor`) of ONE request on its
    own paged pool (page size 1) and query lanes, fed the same K/V and window queries as the SGLang
    request: the reference for "the same policy keeps the same positions"."""

    def __init__(self, kv_cfg: KVCompressionConfig, *, pages: int, q_heads: int = HQ) -> None:
        from sparserl_mcore.rollout.engine.compaction import Compactor
        from sparserl_mcore.rollout.engine.compression_lanes import CompressionLanes
        from sparserl_mcore.rollout.engine.kv_pool import KVPool
        from sparserl_mcore.rollout.engine.request_state import RequestState
        from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

        kv_heads = HK
        self.cfg = kv_cfg
        self.pool = KVPool(
            num_layers=L, num_pages=pages, page_size=1, kv_heads=kv_heads, head_dim=D, dtype=torch.float32,
            device=torch.device("cpu"),
        )  # fmt: skip
        self.lanes = CompressionLanes(
            layers=L, q_heads=q_heads, kv_heads=kv_heads, head_dim=D, window=kv_cfg.window, lanes=1,
            queries=True, mass=False, dtype=torch.float32, device="cpu",
        )  # fmt: skip
        model_cfg = SimpleNamespace(num_layers=L, num_kv_heads=kv_heads, head_dim=D)
        compressor = build_compressor(kv_cfg)
        self.compactor = Compactor(model_cfg, self.pool, kv_cfg, compressor, self.lanes, [])  # type: ignore[arg-type]
        request = GenerateRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=1))
        self.r = RequestState(req=request, rid="ref", generator=torch.Generator(), lane=self.lanes.acquire(0))

    def append(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> None:
        """Entries with K/V [L, t, Hk, d] at the next positions, and (decode) their query [L, Hq, d]."""
        t = k.shape[1]
        pages = self.pool.alloc(t)
        self.r.set_pages(self.r.pages + pages)
        for j, page in enumerate(pages):
            self.pool.k[:, page, 0] = k[:, j]
            self.pool.v[:, page, 0] = v[:, j]
        if q is not None:
            row = self.lanes.ring_row(self.r.lane, self.r.q_seen)
            self.lanes.push_queries(torch.tensor([row]), q[:, None])
            self.r.q_seen += 1
        self.r.n_cached += t
        self.r.next_pos += t

    def compress_if_due(self) -> bool:
        if not self.cfg.should_compress(self.r.n_cached):
            return False
        self.compactor.compress_due([self.r], [self.r], lambda n, _r: self.pool.alloc(n))
        return True

    def kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of its cache entries, [L, n, Hk, d] each, in entry order."""
        pages = torch.tensor(self.r.pages[: self.r.n_cached])
        return self.pool.k[:, pages, 0], self.pool.v[:, pages, 0]


def decode_batch(w: World, reqs: list):
    """SGLang's real `ScheduleBatch` of these running requests, as the scheduler holds it for decode."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    lens = torch.tensor([r.kv.kv_committed_len for r in reqs])
    return ScheduleBatch(
        reqs=reqs, req_to_token_pool=w.rtp, token_to_kv_pool_allocator=w.alloc, tree_cache=w.tree,
        device="cpu", req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs]),
        seq_lens=lens.clone(), seq_lens_cpu=lens.clone(), orig_seq_lens=lens.to(torch.int32),
        spec_algorithm=SpeculativeAlgorithm.NONE, enable_overlap=False,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        sampling_info=SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False)),
    )  # fmt: skip


def attention_layers(q_heads: int = HQ, kv_heads: int = HK) -> torch.nn.ModuleList:
    """SGLang's real RadixAttention layers of one TP rank (its query / KV heads)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return torch.nn.ModuleList(
        RadixAttention(num_heads=q_heads, head_dim=D, scaling=1.0, num_kv_heads=kv_heads, layer_id=i)
        for i in range(L)
    )


def model_runner(
    q_heads: int = HQ, kv_heads: int = HK, total_kv_heads: int = HK, dtype: torch.dtype = torch.float32
) -> SimpleNamespace:
    """The members of SGLang's `ModelRunner` our AFTER hook on `initialize` reads."""
    config = SimpleNamespace(get_total_num_kv_heads=lambda: total_kv_heads)
    model = attention_layers(q_heads, kv_heads)
    return SimpleNamespace(model=model, dtype=dtype, model_config=config, is_draft_worker=False)


def plugin_hooks(method: str, *, max_running_requests: int = 4, runner: SimpleNamespace | None = None, **cfg):
    """Our hooks as the plugin builds them, after SGLang's ModelRunner.initialize (AFTER hook) ran."""
    kv_cfg = KVCompressionConfig(method=method, **{**CFG, **cfg})
    hooks = KVHooks(kv_cfg, max_running_requests=max_running_requests)
    hooks.after_model_init(None, runner or model_runner())
    return hooks


def decode_step(hooks: KVHooks, batch, queries: torch.Tensor | None = None, *, kv_heads: int = HK):
    """One decode step through our hooks and SGLang's own preparation; queries [L, bs, Hq, d] of
    this rank's query heads."""
    from sglang.kernels.ops.attention.clamp_position import clamp_position
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    hooks.before_prepare_for_decode(batch)
    batch.prepare_for_decode()
    bs = len(batch.reqs)
    fb = ForwardBatch(
        forward_mode=batch.forward_mode, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=batch.out_cache_loc,
        seq_lens_sum=int(batch.seq_lens.sum()), positions=clamp_position(batch.seq_lens),
    )  # fmt: skip
    fb = hooks.after_init_new(fb, ForwardBatch, batch, None)
    q_heads = HQ if queries is None else queries.shape[2]
    seen = []
    for layer in range(L):
        attn = RadixAttention(
            num_heads=q_heads, head_dim=D, scaling=1.0, num_kv_heads=kv_heads, layer_id=layer
        )
        q = queries[layer].reshape(bs, -1) if queries is not None else torch.zeros(bs, q_heads * D)
        hooks.around_attention(lambda *args, **kw: seen.append(args[0]), attn, q, None, None, fb)
    assert len(seen) == L  # the original forward always runs
    return fb


REPLICA_STEPS = 5  # decode steps before the budget is reached (more than the window: the ring wraps)


def replica_scenario(method: str, rank: int, world: int) -> dict:
    """One TP rank of a model with ONE KV head compressing a request (tests/sglang_tp_worker.py
    runs it in SGLang's TP=1 and TP=2 worlds): at TP=2 the KV head is replicated on both ranks,
    each holding 2 of the 4 query heads, as `QKVParallelLinear` cuts them. The same K/V (seeded)
    and full-width queries everywhere, each rank's attention seeing its own query heads. Returns
    the K this rank keeps and the entries a selection with only its own query heads would keep."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the seeded values must not depend on the caller's default
    try:
        return _replica_scenario(method, rank, world)
    finally:
        torch.set_default_dtype(previous)


def _replica_scenario(method: str, rank: int, world: int) -> dict:
    w, _, b = world_with_shared_prefix(kv_heads=1)
    n = b.kv.kv_committed_len - REPLICA_STEPS
    w.rtp.req_to_token[b.kv.req_pool_idx, n : b.kv.kv_committed_len] = 0
    b.kv.kv_committed_len = b.kv.kv_allocated_len = n
    q_local = HQ // world
    hooks = plugin_hooks(method, runner=model_runner(q_heads=q_local, kv_heads=1, total_kv_heads=1))
    batch = decode_batch(w, [b])
    gen = torch.Generator().manual_seed(5)
    heads = slice(rank * q_local, (rank + 1) * q_local)
    for _ in range(REPLICA_STEPS):
        decode_step(hooks, batch, torch.randn(L, 1, HQ, D, generator=gen)[:, :, heads], kv_heads=1)
    entries = w.row(b)
    keys = (
        torch.stack([w.kv.k_buffer[layer][entries] for layer in range(L)]).transpose(1, 2).reshape(L, -1, D)
    )
    window = hooks.ring.window_queries(b.kv.req_pool_idx)
    keep = CFG["budget"] - CFG["interval"]
    own_only = hooks.compressor.select(keys, window, keep)
    decode_step(hooks, batch, torch.randn(L, 1, HQ, D, generator=gen)[:, :, heads], kv_heads=1)  # compresses
    kept = w.rtp.req_to_token[b.kv.req_pool_idx, :keep].to(torch.int64)
    return {
        "kept_k": [w.kv.k_buffer[layer][kept].tolist() for layer in range(L)],
        "own_heads_only": own_only.tolist(),
        "evicted": int(hooks.compactor.evicted[b.kv.req_pool_idx]),
    }
