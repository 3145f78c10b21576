"""KV-compression policies: hand-checkable selections, shapes, and the shared trigger rule."""

from __future__ import annotations

import math

import pytest
import torch

from sparserl_mcore.rollout.kvcompress import (
    COMPRESSORS,
    KVCompressionConfig,
    attention_mass,
    build_compressor,
)
from sparserl_mcore.rollout.kvcompress.scoring import redundancy, window_attention

WINDOW = 4


def _cfg(method: str, **kw) -> KVCompressionConfig:
    return KVCompressionConfig(method=method, budget=48, interval=16, window=WINDOW, sink_tokens=2, **kw)


def _random(kv_heads=2, group=2, n=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv_heads, n, d, generator=g)
    queries = torch.randn(kv_heads * group, WINDOW, d, generator=g)
    return keys, queries


def _dominant(keys: torch.Tensor, queries: torch.Tensor, head: int, pos: int) -> None:
    """Make key `pos` of KV head `head` the one every window query of its group attends to."""
    group = queries.shape[0] // keys.shape[0]
    direction = queries[head * group : (head + 1) * group].sum(dim=(0, 1))
    keys[head, pos] = 50.0 * direction / direction.norm()


@pytest.mark.parametrize("method", sorted(COMPRESSORS))
def test_shape_dtype_order_and_window(method):
    keys, queries = _random()
    acc = torch.rand(2, 40)
    idx = build_compressor(_cfg(method)).select(keys, queries, 12, accumulated=acc)
    assert idx.dtype == torch.int64 and idx.shape == (2, 12)
    assert torch.all(idx[:, 1:] > idx[:, :-1]), "ascending, no duplicates"
    assert torch.equal(idx[:, -WINDOW:], torch.arange(36, 40).expand(2, WINDOW))


@pytest.mark.parametrize("method", sorted(COMPRESSORS))
def test_no_op_when_everything_fits(method):
    keys, queries = _random(n=10)
    idx = build_compressor(_cfg(method)).select(keys, queries, 12, accumulated=torch.rand(2, 10))
    assert torch.equal(idx, torch.arange(10).expand(2, 10))


@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_dominant_key_kept_only_by_its_head(method):
    keys, queries = _random()
    _dominant(keys, queries, head=0, pos=5)
    _dominant(keys, queries, head=1, pos=20)
    idx = build_compressor(_cfg(method, kernel_size=1)).select(keys, queries, 8)
    assert 5 in idx[0].tolist() and 20 in idx[1].tolist()
    assert not torch.equal(idx[0], idx[1]), "heads select independently"


def test_maxpool_keeps_neighbours_of_salient_key():
    keys, queries = _random()
    _dominant(keys, queries, head=0, pos=10)
    _dominant(keys, queries, head=1, pos=10)
    # kernel 7: the peak's pooled score spreads to positions 7..13, which then outrank the rest.
    idx = build_compressor(_cfg("snapkv", kernel_size=7)).select(keys, queries, WINDOW + 7)
    assert idx[0, :7].tolist() == list(range(7, 14))


def test_rkv_drops_duplicates_before_unique_keys():
    # Equal attention everywhere (zero queries) -> only redundancy decides: the 20 copies go first.
    keys, _ = _random(kv_heads=1, group=1, n=40)
    keys[0, :20] = keys[0, 0]
    queries = torch.zeros(1, WINDOW, 16)
    idx = build_compressor(_cfg("rkv", kernel_size=1)).select(keys, queries, 24)
    kept_copies = sum(1 for p in idx[0].tolist() if p < 20)
    assert kept_copies <= 4, idx


def test_redundancy_is_a_distribution_and_ignores_dissimilar_keys():
    keys = torch.eye(8).unsqueeze(0)  # orthogonal keys: nothing is redundant
    red = redundancy(keys, threshold=0.5)
    assert torch.allclose(red, torch.full((1, 8), 1 / 8))
    keys[0, 3] = keys[0, 5]
    red = redundancy(keys, threshold=0.5)
    assert red[0, 3] == red[0, 5] and red[0, 3] > red[0, 0]


@pytest.mark.parametrize("tile", [1, 3 * 37 + 5, 10**9])  # one row at a time, uneven tiles, one tile
def test_redundancy_in_tiles_equals_the_whole_similarity_matrix(tile):
    keys, _ = _random(kv_heads=3, n=37)
    keys[1, 10:15] = keys[1, 3]  # near-duplicates, so the threshold keeps something
    unit = torch.nn.functional.normalize(keys, dim=-1)
    sim = unit @ unit.transpose(1, 2)
    sim.diagonal(dim1=1, dim2=2).zero_()
    reference = torch.nn.functional.threshold(sim, 0.5, 0.0).mean(dim=1).softmax(dim=-1)
    torch.testing.assert_close(redundancy(keys, 0.5, tile_elements=tile), reference, rtol=1e-6, atol=1e-7)


def test_redundancy_of_a_long_prompt_never_holds_the_whole_similarity_matrix():
    """R-KV on a long prompt: the [Hk, n, n] fp32 similarity (30 GB for 28 layers x 4 heads at 8k
    positions) is built in tiles; measured: the largest single allocation while scoring."""
    from torch.profiler import ProfilerActivity, profile

    from sparserl_mcore.rollout.kvcompress.scoring import SIMILARITY_TILE_ELEMENTS

    n = 4096  # one head's whole matrix: 64 MiB, twice the tile budget
    keys = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        redundancy(keys, 0.5)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= SIMILARITY_TILE_ELEMENTS * 4 < 2 * n * n * 4


def test_window_attention_is_causal_and_normalised():
    keys, queries = _random(n=12)
    probs = window_attention(keys, queries)
    assert probs.shape == (4, WINDOW, 12)
    assert torch.allclose(probs.sum(-1), torch.ones(4, WINDOW))
    for i in range(WINDOW):  # query i sits at position 12 - WINDOW + i
        assert torch.all(probs[:, i, 12 - WINDOW + i + 1 :] == 0)
    # Independent reference: one head, one query, by hand.
    q, k = queries[0, 0], keys[0, : 12 - WINDOW + 1]
    ref = torch.softmax(k @ q / math.sqrt(16), dim=0)
    assert torch.allclose(probs[0, 0, : 12 - WINDOW + 1], ref, atol=1e-6)


def test_streamingllm_sinks_plus_recent():
    keys, queries = _random()
    idx = build_compressor(_cfg("streamingllm")).select(keys, queries, 10)
    assert idx[0].tolist() == [0, 1] + list(range(32, 40))
    assert torch.equal(idx[0], idx[1])


def test_h2o_heavy_hitters_from_accumulated_attention():
    keys, queries = _random()
    acc = torch.zeros(2, 40)
    acc[0, [3, 7, 11]] = 1.0
    acc[1, [30, 31, 2]] = 1.0
    idx = build_compressor(_cfg("h2o")).select(keys, queries, WINDOW + 3, accumulated=acc)
    assert idx[0].tolist() == [3, 7, 11, 36, 37, 38, 39]
    assert idx[1].tolist() == [2, 30, 31, 36, 37, 38, 39]
    with pytest.raises(ValueError, match="accumulated"):
        build_compressor(_cfg("h2o")).select(keys, queries, 8)
    keys, queries = _random(group=1)  # without GQA max, each head's mass sums to the window size
    mass = attention_mass(keys, queries)
    assert mass.shape == (2, 40) and torch.allclose(mass.sum(-1), torch.full((2,), float(WINDOW)))


def test_window_queries_optional_only_where_unused():
    keys, queries = _random()
    acc = torch.rand(2, 40)
    for method in ("streamingllm", "h2o"):
        comp = build_compressor(_cfg(method))
        assert not comp.needs_window_queries
        assert torch.equal(comp.select(keys, None, 12, acc), comp.select(keys, queries, 12, acc))
    for method in ("snapkv", "rkv"):
        with pytest.raises(ValueError, match="window queries"):
            build_compressor(_cfg(method)).select(keys, None, 12)


def test_bfloat16_inputs_and_bad_shapes():
    keys, queries = _random()
    idx = build_compressor(_cfg("snapkv")).select(keys.bfloat16(), queries.bfloat16(), 12)
    assert idx.shape == (2, 12) and idx.dtype == torch.int64
    comp = build_compressor(_cfg("snapkv"))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        comp.select(keys, queries[:3], 12)
    with pytest.raises(ValueError, match="window"):
        comp.select(keys, queries, 2)


def test_config_trigger_and_validation():
    cfg = KVCompressionConfig(method="snapkv")
    assert (cfg.budget, cfg.interval, cfg.window, cfg.kernel_size, cfg.keep_tokens) == (512, 128, 8, 7, 384)
    assert not cfg.should_compress(511) and cfg.should_compress(512)
    assert not KVCompressionConfig().should_compress(10_000)
    assert build_compressor(KVCompressionConfig()) is None
    with pytest.raises(ValueError, match="method='bogus'"):
        KVCompressionConfig(method="bogus")
    with pytest.raises(ValueError, match="budget=64 <= interval=128"):
        KVCompressionConfig(method="rkv", budget=64)
    with pytest.raises(ValueError, match="kernel_size=4"):
        KVCompressionConfig(method="rkv", kernel_size=4)
    with pytest.raises(ValueError, match="rkv_lambda"):
        KVCompressionConfig(method="rkv", rkv_lambda=1.5)
