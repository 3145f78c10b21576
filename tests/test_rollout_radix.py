"""Radix prefix cache and page pool on their own: page-aligned matches, node splits, reference
counts, LRU eviction of unreferenced leaves only, flush; and the sampler's filters."""

from __future__ import annotations

import torch

from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.radix_cache import RadixCache
from sparserl_mcore.rollout.engine.sampler import sample
from sparserl_mcore.rollout.protocol import SamplingParams

PS = 4


def _pool(pages: int = 16) -> KVPool:
    return KVPool(
        num_layers=1, num_pages=pages, page_size=PS, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu"
    )


def _cached(radix: RadixCache, pool: KVPool, tokens: tuple[int, ...]) -> list[int]:
    """Simulate a request: allocate pages for `tokens`, cache them, release the request's refs."""
    pages = pool.alloc(len(tokens) // PS)
    radix.insert(tokens, pages)
    pool.decref(pages)
    return pages


def test_match_is_page_aligned_splits_nodes_and_counts_references():
    pool = _pool()
    radix = RadixCache(pool)
    a = tuple(range(12))  # 3 pages
    pages_a = _cached(radix, pool, a)
    assert all(pool.refs[p] == 1 for p in pages_a) and radix.num_pages == 3
    b = a[:8] + (99, 98, 97, 96)  # shares 2 pages, then diverges -> the node splits
    hit = radix.match(b, limit=len(b))
    assert hit == pages_a[:2] and all(pool.refs[p] == 2 for p in hit)
    assert radix.match(a[:7], limit=7) == pages_a[:1]  # partial second page: not matched
    pool.decref(pages_a[:1])
    pool.decref(hit)
    pages_b = pool.alloc(1)
    radix.insert(b, hit + pages_b)  # cached part wins, the new tail page joins the tree
    pool.decref(pages_b)
    assert radix.num_pages == 4 and radix.match(b, len(b)) == hit + pages_b
    assert radix.stats.hit_tokens == 8 + 4 + 12 and radix.stats.queried_tokens == 12 + 7 + 12


def test_eviction_is_lru_over_unreferenced_leaves_and_flush_keeps_live_requests():
    pool = _pool(pages=8)
    radix = RadixCache(pool)
    old = _cached(radix, pool, tuple(range(100, 108)))
    new = _cached(radix, pool, tuple(range(200, 208)))
    busy = radix.match(tuple(range(300, 304)), 4)  # miss
    assert busy == []
    live = _cached(radix, pool, tuple(range(300, 308)))
    held = radix.match(tuple(range(300, 308)), 8)  # a running request holds these
    radix.match(tuple(range(200, 208)), 8)  # touch `new` (and hold it too)
    pool.decref(new)
    assert radix.evict(2) == 2 and all(pool.refs[p] == 0 for p in old)  # the LRU, unreferenced leaf
    assert radix.evict(10) == 2  # `new` went next; `live` is referenced and stays
    assert all(pool.refs[p] == 2 for p in held)
    radix.flush()
    assert radix.num_pages == 0 and all(pool.refs[p] == 1 for p in live)  # the request still owns them
    pool.decref(held)
    assert pool.num_free == pool.num_pages


def test_sampler_filters_and_logprob_convention():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 3)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=0.05),
    ]
    tokens, logprobs = sample(logits, params, gens)
    assert tokens == [0, 0, 0]  # greedy, top-1, and a nucleus holding only the best token
    expected = [torch.log_softmax(logits[0], -1)[0]] + [torch.log_softmax(logits[0] / 2.0, -1)[0]] * 2
    torch.testing.assert_close(torch.tensor(logprobs), torch.stack(expected))  # before filtering
    draws = {sample(logits[:1], [SamplingParams(top_k=2)], [gens[0]])[0][0] for _ in range(200)}
    assert draws == {0, 1}
