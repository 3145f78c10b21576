"""KV compaction inside SGLang 0.5.23's REAL pools on CPU, with a radix-shared prompt prefix.

Built from SGLang's own classes and request lifecycle functions: `MHATokenToKVPool`,
`TokenToKVPoolAllocator`, `ReqToTokenPool`, `RadixCache`, `Req`; request A's prompt enters the
radix tree through `mem_cache/common.py: checkpoint_kv_cache` (as after a prefill), request B
matches it through `Req.init_next_round_input` (so B's `cache_protected_len` comes from SGLang),
B decodes past the budget, our compactor compresses it, and B is released through SGLang's own
`release_kv_cache(..., checkpoint=True)`. What is not built here: `ScheduleBatch` and the
scheduler (`srt/managers/scheduler.py` does not import with the CPU stubs, tests/sglang_cpu.py);
the hook wiring is tested on the objects it receives in tests/test_sglang_kv_hooks.py.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang_cpu import require_sglang

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, build_compressor

L, HK, HQ, D = 3, 2, 4, 8  # layers, KV heads, query heads (GQA 2), head dim
PROMPT = list(range(100, 110))  # 10 tokens, radix-shared
CFG = dict(
    budget=24, interval=8, window=4, sink_tokens=2
)  # keep_tokens 16; own keep 6 after a 10-token prefix


@pytest.fixture(autouse=True)
def _sglang():
    """SGLang importable, and its runtime context published (its release path reads the serving
    and speculative settings from it), as a server process would have it."""
    require_sglang()
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0))
    yield
    reset_context()


class World:
    """SGLang's real pools and radix tree, sized small, with K/V of every slot a distinct value."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.kv = MHATokenToKVPool(
            size=128, page_size=1, dtype=torch.float32, head_num=HK, head_dim=D, layer_num=L,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.alloc = TokenToKVPoolAllocator(
            size=128, dtype=torch.float32, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1
            )
        )
        gen = torch.Generator().manual_seed(0)
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen))

    def admit(self, rid: str, prompt: list[int]):
        """A request through SGLang's prefix match, its row and its own slots for the unmatched prompt."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=64))
        req.init_next_round_input(self.tree)  # sets prefix_len, last_node and cache_protected_len
        req.lock = self.tree.lock(req.last_node)
        (row,) = self.rtp.alloc([req])
        prefix = self.tree.path_device_indices(req.last_node)
        self.rtp.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(prefix)
        req.extend_end = len(prompt)
        self.grow(req, len(prompt) - len(prefix))
        return req

    def grow(self, req, n: int, tokens: list[int] | None = None) -> None:
        """n more tokens with KV (prefill remainder, or decode steps when `tokens` are outputs)."""
        slots = self.alloc.alloc(n)
        start = req.kv.kv_committed_len
        self.rtp.write((req.kv.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n
        if tokens is not None:
            req.output_ids.extend(tokens)

    def row(self, req) -> torch.Tensor:
        return self.rtp.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64).clone()


def _world_with_shared_prefix() -> tuple[World, object, object]:
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    w = World()
    a = w.admit("a", PROMPT)
    checkpoint_kv_cache(a, w.tree)  # A's prompt enters the radix tree, as after its prefill
    b = w.admit("b", PROMPT + [7, 8, 9])
    assert b.kv.cache_protected_len == len(PROMPT)  # the radix tree owns the shared prompt
    w.grow(b, 11, tokens=list(range(200, 211)))  # decode: own tail = 14 = own keep 6 + interval 8
    return w, a, b


def _compactor(w: World, method: str):
    from sparserl_mcore.sglang.kv_compaction import SGLangCompactor

    cfg = KVCompressionConfig(method=method, **CFG)
    return SGLangCompactor(cfg, build_compressor(cfg), w.tree)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "rkv"])
def test_compaction_in_sglang_pools_keeps_the_shared_prefix_and_frees_the_rest(method):
    w, a, b = _world_with_shared_prefix()
    comp = _compactor(w, method)
    P, n = b.kv.cache_protected_len, b.kv.kv_committed_len
    row_before, a_row = w.row(b), w.row(a)
    k_before = [x.clone() for x in w.kv.k_buffer]
    v_before = [x.clone() for x in w.kv.v_buffer]
    free_before = w.alloc.available_size()
    queries = torch.randn(L * HQ, CFG["window"], D, generator=torch.Generator().manual_seed(1))
    own = row_before[P:]
    keys = (
        torch.stack([k_before[layer][own] for layer in range(L)]).transpose(1, 2).reshape(L * HK, len(own), D)
    )
    expected = comp.compressor.select(keys, queries, comp.own_keep(P)).view(L, HK, -1)

    assert comp.due(b)
    result = comp.compress(b, queries if comp.compressor.needs_window_queries else None)

    keep = comp.own_keep(P)
    assert (result.freed, result.kv_len) == (len(own) - keep, P + keep) == (8, P + 6)
    assert w.alloc.available_size() == free_before + result.freed
    assert (b.kv.kv_committed_len, b.kv.kv_allocated_len) == (P + keep, P + keep)
    assert b.skip_radix_cache_insert and not a.skip_radix_cache_insert
    assert int(comp.evicted[b.kv.req_pool_idx]) == n - result.kv_len  # next RoPE position = kv len + this
    row_after = w.row(b)
    assert torch.equal(row_after[:P], row_before[:P])  # shared slots: same slots ...
    assert torch.equal(w.row(a), a_row)
    shared = row_before[:P]
    for layer in range(L):  # ... and untouched K/V there
        assert torch.equal(w.kv.k_buffer[layer][shared], k_before[layer][shared])
        assert torch.equal(w.kv.v_buffer[layer][shared], v_before[layer][shared])
    assert torch.equal(row_after[P:], own[:keep])  # compacted into the request's own first slots
    if method == "streamingllm":  # sinks of the tail + the last window, the same for every head
        assert expected[0, 0].tolist() == [0, 1, 10, 11, 12, 13]
    for layer in range(L):
        for h in range(HK):
            src = own[expected[layer, h]]
            for after, before in ((w.kv.k_buffer, k_before), (w.kv.v_buffer, v_before)):
                assert torch.equal(after[layer][own[:keep], h], before[layer][src, h])  # bit-equal
    freed = set(own[keep:].tolist())
    assert freed.isdisjoint(set(row_after.tolist()))
    assert freed <= set(w.alloc.free_pages.tolist())


def test_a_compressed_request_is_not_inserted_into_the_radix_tree_by_sglangs_release():
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    sizes = {}
    for compress in (False, True):
        w, a, b = _world_with_shared_prefix()
        tree_before, free_before = w.tree.total_size(), w.alloc.available_size()
        if compress:
            freed = _compactor(w, "streamingllm").compress(b, None).freed
        else:
            freed = 0
        owned = b.kv.kv_committed_len - b.kv.cache_protected_len
        b.finished_reason = FINISH_LENGTH(length=len(b.output_ids))
        release_kv_cache(b, w.tree, checkpoint=True)
        sizes[compress] = w.tree.total_size() - tree_before
        if compress:  # every own slot is back, none went to the tree
            assert w.alloc.available_size() == free_before + freed + owned
        assert b.kv.req_pool_idx is None
    assert sizes[False] > 0  # the uncompressed request WAS inserted (the check can fail)
    assert sizes[True] == 0


def test_not_due_below_the_budget_and_rows_reset():
    w, a, b = _world_with_shared_prefix()
    comp = _compactor(w, "streamingllm")
    w2, _, b2 = _world_with_shared_prefix()
    b2.kv.kv_committed_len -= 1  # one decode step short (the row is only read by compress)
    assert comp.due(b) and not _compactor(w2, "streamingllm").due(b2)
    comp.compress(b, None)
    comp.reset_rows([b.kv.req_pool_idx])
    assert int(comp.evicted[b.kv.req_pool_idx]) == 0


def test_unsupported_pools_are_refused():
    w = World()
    w.alloc.page_size = 16  # what a paged allocator reports
    with pytest.raises(ValueError, match="--page-size 1"):
        _compactor(w, "streamingllm")
