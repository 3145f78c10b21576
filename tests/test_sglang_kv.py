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

import pytest
import torch
from sglang_kv_world import CFG, HK, HQ, D, L, World, compactor, sglang_context, world_with_shared_prefix

pytestmark = pytest.mark.usefixtures(sglang_context.__name__)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "rkv"])
def test_compaction_in_sglang_pools_keeps_the_shared_prefix_and_frees_the_rest(method):
    w, a, b = world_with_shared_prefix()
    comp = compactor(w, method)
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
        w, a, b = world_with_shared_prefix()
        tree_before, free_before = w.tree.total_size(), w.alloc.available_size()
        if compress:
            freed = compactor(w, "streamingllm").compress(b, None).freed
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
    w, a, b = world_with_shared_prefix()
    comp = compactor(w, "streamingllm")
    w2, _, b2 = world_with_shared_prefix()
    b2.kv.kv_committed_len -= 1  # one decode step short (the row is only read by compress)
    assert comp.due(b) and not compactor(w2, "streamingllm").due(b2)
    comp.compress(b, None)
    comp.reset_rows([b.kv.req_pool_idx])
    assert int(comp.evicted[b.kv.req_pool_idx]) == 0


def test_unsupported_pools_are_refused():
    w = World()
    w.alloc.page_size = 16  # what a paged allocator reports
    with pytest.raises(ValueError, match="--page-size 1"):
        compactor(w, "streamingllm")
