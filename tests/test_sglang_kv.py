"""KV compaction inside SGLang 0.5.23's REAL pools on CPU, with a radix-shared prompt prefix.

Built from SGLang's own classes and request lifecycle functions: `MHATokenToKVPool`,
`TokenToKVPoolAllocator`, `ReqToTokenPool`, `Req`, and both radix caches (0.5.23's default
`UnifiedRadixCache` and the legacy `RadixCache`); request A's prompt enters the radix tree through
`mem_cache/common.py: checkpoint_kv_cache` (as after a prefill), request B matches it through
`Req.init_next_round_input` (so B's `cache_protected_len` comes from SGLang), B decodes past the
budget, our compactor compresses it, and B is released through SGLang's own `release_kv_cache`.
The reference for what is kept is the embedded engine's compaction (`rollout/engine/compaction.py`) fed
the same K/V and queries. What is not built here: `ScheduleBatch` and the scheduler
(a live scheduler runs them in tests/test_sglang_live.py); the hook
wiring is tested on the objects it receives in tests/test_sglang_kv_hooks.py.
"""

from __future__ import annotations

import pytest
import torch
from sglang_kv_world import (
    CACHES,
    CFG,
    HK,
    HQ,
    D,
    EmbeddedReference,
    L,
    World,
    compactor,
    sglang_context,
    world_with_shared_prefix,
)

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

pytestmark = pytest.mark.usefixtures(sglang_context.__name__)


def _kv(w: World, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of these slots, [L, n, Hk, d] each (copies)."""
    return (
        torch.stack([w.kv.k_buffer[layer][slots] for layer in range(L)]),
        torch.stack([w.kv.v_buffer[layer][slots] for layer in range(L)]),
    )


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "rkv"])
def test_a_radix_shared_400_token_prompt_keeps_the_embedded_engines_positions(cache, method):
    """Budget 512, interval 128: B's 400-token prompt is A's (radix-shared, inserted by SGLang's
    checkpoint after A's prefill). Two compressions (at 512 entries, then again after 128 more):
    after each, B's cache holds bit for bit the entries the embedded engine keeps for the same K/V
    and queries; A's shared slots are never written."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    kv_cfg = KVCompressionConfig(method=method, budget=512, interval=128)  # window 8, sinks 4
    w = World(cache, slots=2048, rows=4, context=1024)
    prompt = list(range(1000, 1400))
    a = w.admit("a", prompt)
    checkpoint_kv_cache(a, w.tree)
    b = w.admit("b", prompt)
    assert b.kv.cache_protected_len == 399  # SGLang matches all but the last prompt token
    comp = compactor(w, kv_cfg)
    ref = EmbeddedReference(kv_cfg, pages=1024)
    ref.append(*_kv(w, w.row(b)))
    a_row, a_kv = w.row(a), _kv(w, w.row(a))
    gen = torch.Generator().manual_seed(11)
    queries: list[torch.Tensor] = []
    compressions = 0
    for step in range(112 + 128):
        (slot,) = w.grow(b, 1, tokens=[step])
        q = torch.randn(L, HQ, D, generator=gen)
        queries = [*queries, q][-kv_cfg.window :]
        ref.append(*_kv(w, slot[None]), q)
        if comp.due(b):  # what the BEFORE hook does before SGLang's next prepare_for_decode
            window = torch.stack(queries, dim=2).reshape(L * HQ, len(queries), D)  # [L*Hq, w, d]
            n = b.kv.kv_committed_len
            result = comp.compress(b, window if comp.compressor.needs_window_queries else None)
            assert ref.compress_if_due()
            compressions += 1
            assert result.kv_len == b.kv.kv_committed_len == ref.r.n_cached == kv_cfg.keep_tokens
            assert (
                int(comp.evicted[b.kv.req_pool_idx]) == ref.r.evictions == compressions * (n - result.kv_len)
            )
            for mine, theirs in zip(_kv(w, w.row(b)), ref.kept(), strict=True):
                assert torch.equal(mine, theirs)  # the same entries, in the same order, bit for bit
        else:
            assert not ref.compress_if_due()
    assert compressions == 2
    assert torch.equal(w.row(a), a_row)  # A's row and its (shared) slots' K/V never touched
    for now, before in zip(_kv(w, a_row), a_kv, strict=True):
        assert torch.equal(now, before)
    assert b.skip_radix_cache_insert and not a.skip_radix_cache_insert
    free_before, tree_before = w.alloc.available_size(), w.tree_tokens()
    private = b.kv.kv_committed_len - b.kv.cache_protected_len
    b.finished_reason = FINISH_LENGTH(length=len(b.output_ids))
    release_kv_cache(b, w.tree, checkpoint=True)  # SGLang's release of a finished request
    assert w.alloc.available_size() == free_before + private  # every private slot is back
    assert w.tree_tokens() == tree_before  # nothing of B's compacted row entered the tree
    assert (
        w.alloc.available_size() + w.tree_tokens() + (a.kv.kv_committed_len - a.kv.cache_protected_len)
        == 2048
    )


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "rkv"])
def test_compaction_copies_what_it_keeps_from_shared_slots_and_frees_the_rest(cache, method):
    """B: a 10-entry shared prefix + 14 own entries = the budget (24). The policy chooses over all
    24; the leading entries every head keeps in place stay on their shared slots, the other kept
    entries are written to B's own slots (plus fresh ones when its own slots are too few), the
    rest of its own slots go back to SGLang's allocator."""
    w, a, b = world_with_shared_prefix(cache)
    comp = compactor(w, method)
    P, n, keep = b.kv.cache_protected_len, b.kv.kv_committed_len, comp.cfg.keep_tokens
    row_before, a_row = w.row(b), w.row(a)
    k_before = [x.clone() for x in w.kv.k_buffer]
    v_before = [x.clone() for x in w.kv.v_buffer]
    free_before = w.alloc.available_size()
    queries = torch.randn(L * HQ, CFG["window"], D, generator=torch.Generator().manual_seed(1))
    keys = (
        torch.stack([k_before[layer][row_before] for layer in range(L)]).transpose(1, 2).reshape(L * HK, n, D)
    )
    expected = comp.compressor.select(keys, queries, keep).view(L, HK, keep)
    in_place = int((expected == torch.arange(keep)).flatten(0, 1).all(0).sum())

    assert comp.due(b)
    result = comp.compress(b, queries if comp.compressor.needs_window_queries else None)

    if method == "streamingllm":  # the 2 sinks stay on their shared slots, then the last 14
        assert expected[0, 0].tolist() == [0, 1, *range(10, 24)] and in_place == 2
    shared = min(in_place, P)
    own, need = n - P, keep - shared
    assert (result.kv_len, result.shared) == (keep, shared)
    assert (result.freed, result.allocated) == (max(0, own - need), max(0, need - own))
    assert w.alloc.available_size() == free_before + result.freed - result.allocated
    assert (b.kv.kv_committed_len, b.kv.kv_allocated_len, b.kv.cache_protected_len) == (keep, keep, shared)
    assert b.skip_radix_cache_insert and not a.skip_radix_cache_insert
    assert int(comp.evicted[b.kv.req_pool_idx]) == n - keep  # next RoPE position = kv len + this
    row_after = w.row(b)
    assert torch.equal(row_after[:shared], row_before[:shared])  # still the shared slots
    private = set(row_after[shared:].tolist())
    assert private.isdisjoint(set(row_before[:P].tolist()))  # nothing kept points at a shared slot
    assert set(row_before[P : P + min(need, own)].tolist()) <= private  # own slots reused first
    assert torch.equal(w.row(a), a_row)
    for layer in range(L):  # shared slots: untouched K/V
        for after, before in ((w.kv.k_buffer, k_before), (w.kv.v_buffer, v_before)):
            assert torch.equal(after[layer][row_before[:P]], before[layer][row_before[:P]])
        for h in range(HK):  # kept entry j of head h = the chosen entry, bit for bit
            src = row_before[expected[layer, h]]
            for after, before in ((w.kv.k_buffer, k_before), (w.kv.v_buffer, v_before)):
                assert torch.equal(after[layer][row_after, h], before[layer][src, h])
    freed = set(row_before[P:].tolist()) - private
    assert len(freed) == result.freed and freed <= set(w.alloc.free_pages.tolist())


@pytest.mark.parametrize("cache", CACHES)
def test_a_compressed_request_is_not_inserted_into_the_radix_tree_by_sglangs_release(cache):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    sizes = {}
    for compress in (False, True):
        w, a, b = world_with_shared_prefix(cache)
        if compress:
            compactor(w, "streamingllm").compress(b, None)
        tree_before, free_before = w.tree_tokens(), w.alloc.available_size()
        owned = b.kv.kv_committed_len - b.kv.cache_protected_len
        b.finished_reason = FINISH_LENGTH(length=len(b.output_ids))
        release_kv_cache(b, w.tree, checkpoint=True)
        sizes[compress] = w.tree_tokens() - tree_before
        if compress:  # every private slot is back, none went to the tree
            assert w.alloc.available_size() == free_before + owned
        assert b.kv.req_pool_idx is None
    assert sizes[False] > 0  # the uncompressed request WAS inserted (the check can fail)
    assert sizes[True] == 0


@pytest.mark.parametrize("cache", CACHES)
def test_not_due_below_the_budget_and_rows_reset(cache):
    w, a, b = world_with_shared_prefix(cache)
    comp = compactor(w, "streamingllm")
    w2, _, b2 = world_with_shared_prefix(cache)
    b2.kv.kv_committed_len -= 1  # one decode step short (the row is only read by compress)
    assert comp.due(b) and not compactor(w2, "streamingllm").due(b2)
    comp.compress(b, None)
    comp.reset_rows([b.kv.req_pool_idx])
    assert int(comp.evicted[b.kv.req_pool_idx]) == 0


def test_a_compression_that_needs_slots_the_pool_cannot_spare_waits():
    """Copying kept entries off shared slots takes fresh slots; with fewer free than that plus the
    step's decode tokens (`reserve`), nothing changes and the request is compressed later."""
    w, a, b = world_with_shared_prefix()
    comp = compactor(w, "snapkv")
    queries = torch.randn(L * HQ, CFG["window"], D, generator=torch.Generator().manual_seed(1))
    idx = comp.select(b, queries)
    need = comp.cfg.keep_tokens - min(
        int((idx == torch.arange(idx.shape[-1])).flatten(0, 1).all(0).sum()), 10
    )
    extra = need - 14
    assert extra > 0  # snapkv keeps shared entries here: it needs fresh slots
    hold = w.alloc.alloc(w.alloc.available_size() - extra)  # exactly `extra` left: no room for the decode
    row, n = w.row(b), b.kv.kv_committed_len
    result = comp.compress(b, queries, reserve=1)
    assert (result.kv_len, result.allocated, result.freed) == (n, 0, 0)
    assert torch.equal(w.row(b), row) and not b.skip_radix_cache_insert
    w.alloc.free(hold[:1])
    assert comp.compress(b, queries, reserve=1).allocated == extra


@pytest.mark.parametrize("cache", CACHES)
def test_unsupported_pools_are_refused(cache):
    w = World(cache)
    w.alloc.page_size = 16  # what a paged allocator reports
    with pytest.raises(ValueError, match="--page-size 1"):
        compactor(w, "streamingllm")
