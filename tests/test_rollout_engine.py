"""EmbeddedEngine end to end on tiny random models, checked against independent references:
HF transformers greedy generation, a dense whole-sequence recompute of the returned log-probs, and
a recompute restricted to the positions each compression kept (per layer and KV head)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy, tiny_qwen2

from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.kvcompress import METHODS, KVCompressionConfig
from sparserl_mcore.rollout.protocol import (
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightVersionConflict,
)

VOCAB = 160
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return tiny_qwen2(path, VOCAB), path


def _engine(path, **kw) -> EmbeddedEngine:
    kw.setdefault("page_size", 4)
    kw.setdefault("capacity_pages", 256)
    return EmbeddedEngine(path, EngineConfig(device="cpu", **kw))


def _prompts(n: int, seed: int = 1, lengths=(5, 11, 17, 8)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _recomputed_logprobs(engine, sample, temperature: float, kv_masks=None) -> torch.Tensor:
    seq = torch.tensor(list(sample.prompt_ids) + list(sample.output_ids[:-1]))
    logits = engine.model.forward_reference(seq, kv_masks)[len(sample.prompt_ids) - 1 :]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(sample.output_ids)[:, None])[:, 0]


def test_greedy_matches_hf_generate_and_pages_return(hf_model):
    model, path = hf_model
    engine = _engine(path)
    assert isinstance(engine, RolloutEngine)
    prompts = _prompts(6)
    samples = engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in prompts])
    for prompt, sample in zip(prompts, samples, strict=True):
        assert list(sample.output_ids) == hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert sample.finish_reason == "length" and sample.kv_stats.evictions == 0
        assert sample.kv_stats.peak_retained_tokens == len(prompt) + GREEDY.max_new_tokens - 1
    assert engine.pool.num_free + engine.radix.num_pages == engine.pool.num_pages
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_sampled_logprobs_equal_dense_recompute(hf_model):
    _, path = hf_model
    engine = _engine(path)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=30, ignore_eos=True, seed=5)
    # unseeded, unfiltered rows share the engine's generator and draw in one batched call
    pure = SamplingParams(temperature=1.3, max_new_tokens=30, ignore_eos=True)
    samples = engine.generate(
        [GenerateRequest(input_ids=p, sampling=params) for p in _prompts(4)]
        + [GenerateRequest(input_ids=p, sampling=pure) for p in _prompts(3, seed=2)]
    )
    for s, temperature in zip(samples, [params.temperature] * 4 + [pure.temperature] * 3, strict=True):
        ref = _recomputed_logprobs(engine, s, temperature)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), ref, atol=1e-4, rtol=0)
    # A seed fixes the draws whatever else shares the batch.
    again = engine.generate([GenerateRequest(input_ids=samples[2].prompt_ids, sampling=params)])[0]
    assert again.output_ids == samples[2].output_ids


def _masks_from_events(engine, sample, events) -> list[torch.Tensor]:
    """Per layer [Hk, T, T]: query row q reads the positions kept by the last compression before it
    plus everything after that compression (prompt prefill and decode until then: all of <= q)."""
    cfg = engine.model.cfg
    T = len(sample.prompt_ids) + len(sample.output_ids) - 1
    masks = torch.ones(cfg.num_layers, cfg.num_kv_heads, T, T, dtype=torch.bool)
    for kept, next_pos in events:
        rows = slice(next_pos, T)
        masks[:, :, rows, :next_pos] = False
        for layer in range(cfg.num_layers):
            for head in range(cfg.num_kv_heads):
                masks[layer, head, rows, kept[layer, head]] = True
    return list(masks)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_compressed_logprobs_equal_retained_positions_recompute(hf_model, method):
    _, path = hf_model
    kv = KVCompressionConfig(method=method, budget=24, interval=6, window=4, sink_tokens=2)
    engine = _engine(path, kv_compression=kv)
    events: dict[str, list] = {}
    engine.add_compression_listener(
        lambda rid, kept, pos: events.setdefault(rid, []).append((kept.clone(), pos))
    )
    prompt = _prompts(1, seed=3, lengths=(14,))[0]  # shared by the group: its first 3 pages are radix pages
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=i) for i in range(3)]
    samples = engine.generate(
        [GenerateRequest(input_ids=prompt, sampling=p, rid=f"r{i}") for i, p in enumerate(params)]
        + [GenerateRequest(input_ids=_prompts(1, seed=4, lengths=(30,))[0], sampling=params[0], rid="long")]
    )
    assert sum(s.cached_prompt_tokens > 0 for s in samples) >= 2
    for s in samples:
        # hard cap: never more than the budget, except a longer prompt right after its prefill
        assert s.kv_stats.peak_retained_tokens == max(kv.budget, len(s.prompt_ids))
        assert s.kv_stats.compressions >= 2
        masks = _masks_from_events(engine, s, events[s.rid])
        ref = _recomputed_logprobs(engine, s, 1.0, masks)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), ref, atol=1e-4, rtol=0)
        dense = _recomputed_logprobs(engine, s, 1.0)
        assert (dense - ref).abs().max() > 1e-4  # the restriction is real
    # Shared prompt pages survived every copy-on-write compression: a cache hit still decodes exactly.
    plain = _engine(path)
    hit, fresh = (
        e.generate(
            [GenerateRequest(input_ids=prompt, sampling=GREEDY.__class__(temperature=0.0, max_new_tokens=8))]
        )
        for e in (engine, plain)
    )
    assert hit[0].cached_prompt_tokens == 12 and hit[0].output_ids == fresh[0].output_ids
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("method", ["rkv", "h2o"])
def test_compression_under_retraction(hf_model, method):
    """A pool too small for the batch: requests are retracted mid-compression-cycle and restart;
    every sample still equals the recompute over its retained positions, and the per-request lanes
    (window queries, h2o mass) and pages all come back."""
    _, path = hf_model
    kv = KVCompressionConfig(method=method, budget=16, interval=4, window=4, sink_tokens=2)
    engine = _engine(path, kv_compression=kv, capacity_pages=26, max_running_requests=8)
    events: dict[str, list] = {}

    def record(rid, kept, pos):
        runs = events.setdefault(rid, [])
        if runs and pos <= runs[-1][1]:  # a retracted request restarted: only its last run counts
            runs.clear()
        runs.append((kept.clone(), pos))

    engine.add_compression_listener(record)
    params = [SamplingParams(temperature=1.0, max_new_tokens=28, ignore_eos=True, seed=i) for i in range(8)]
    samples = engine.generate(
        [
            GenerateRequest(input_ids=q, sampling=p, rid=f"r{i}")
            for i, (q, p) in enumerate(zip(_prompts(8), params, strict=True))
        ]
    )
    assert engine.stats()["retractions"] > 0
    for s in samples:
        assert s.kv_stats.compressions >= 2
        ref = _recomputed_logprobs(engine, s, 1.0, _masks_from_events(engine, s, events[s.rid]))
        torch.testing.assert_close(torch.tensor(s.output_logprobs), ref, atol=1e-4, rtol=0)
    lanes = engine.scheduler.lanes
    assert lanes.num_free == lanes.num_lanes
    if lanes.mass is not None:
        assert not lanes.mass.any(), "released lanes hold no stale attention mass"
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_fixed_pool_decodes_more_requests_at_once_under_compression(hf_model):
    """The memory claim of KV compression as the engine sees it: with the same pool, requests whose KV
    is capped by the budget hold fewer pages, so more of them decode in each step and fewer are
    retracted (pool: 8 pages of 4 tokens per request at full length, for 4 requests; 16 requests)."""
    _, path = hf_model
    params = SamplingParams(temperature=1.0, max_new_tokens=28, ignore_eos=True)
    counts = {}
    for method in ("none", "streamingllm"):
        kv = KVCompressionConfig(method=method, budget=8, interval=2, window=2, sink_tokens=2)
        engine = _engine(path, kv_compression=kv, capacity_pages=32, max_running_requests=16)
        prompts = _prompts(16, lengths=(4,))
        samples = engine.generate([GenerateRequest(input_ids=q, sampling=params) for q in prompts])
        assert all(len(s.output_ids) == 28 for s in samples)
        stats = engine.stats()
        assert stats["peak_running"] <= 16
        counts[method] = (stats["batched_requests"] / stats["steps"], stats["retractions"])
    (dense, dense_retracted), (compressed, compressed_retracted) = counts["none"], counts["streamingllm"]
    assert compressed > 1.5 * dense and compressed_retracted < dense_retracted, counts


def test_concurrent_callers_share_prefix_and_survive_retraction(hf_model):
    """Threads submit overlapping groups into a pool too small for all: radix hits, retractions,
    and every greedy result still equals HF transformers."""
    model, path = hf_model
    engine = _engine(path, capacity_pages=40, max_running_requests=8)
    system = _prompts(1, seed=7, lengths=(12,))[0]
    prompts = [system + p for p in _prompts(6, seed=8, lengths=(3, 6))]
    results: dict[int, list] = {}

    def caller(i: int) -> None:
        reqs = [GenerateRequest(input_ids=prompts[i], sampling=GREEDY) for _ in range(3)]
        results[i] = engine.generate(reqs)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert [list(s.output_ids) for s in results[i]] == [ref] * 3
    stats = engine.stats()
    assert stats["radix_hit_tokens"] > 0 and stats["retractions"] > 0
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_stops_abort_and_pool_exhaustion(hf_model):
    _, path = hf_model
    engine = _engine(path)
    prompt = _prompts(1)[0]
    free_run = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0].output_ids
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    stopped = engine.generate(
        [GenerateRequest(input_ids=prompt, sampling=SamplingParams(temperature=0, stop_token_ids=[stop_tok]))]
    )[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free_run[: first + 1]
    eos = engine.generate([GenerateRequest(input_ids=prompt, sampling=SamplingParams(temperature=0))])[0]
    assert VOCAB - 1 not in eos.output_ids[:-1]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate([GenerateRequest(input_ids=prompt, sampling=SamplingParams(stop=["x"]))])
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([GenerateRequest(input_ids=[VOCAB], sampling=GREEDY)])
    tiny = _engine(path, capacity_pages=2)
    with pytest.raises(ValueError, match="more than the whole KV pool"):  # refused before it runs
        tiny.generate([GenerateRequest(input_ids=list(range(20)), sampling=GREEDY)])
    assert tiny.pool.num_free == 2  # the oversized prompt failed alone; the engine still serves
    fits = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    assert len(tiny.generate([GenerateRequest(input_ids=[1, 2, 3], sampling=fits)])[0].output_ids) == 4

    engine.pause()
    box = []
    worker = threading.Thread(
        target=lambda: box.extend(engine.generate([GenerateRequest(input_ids=prompt, rid="x")]))
    )
    worker.start()
    engine.abort("x")
    engine.resume()
    worker.join(60)
    assert box[0].finish_reason == "abort" and box[0].rid == "x"


def test_weight_updates_flush_cache_and_apply_sync_patches(hf_model):
    from sparserl_mcore.sync.codec import encode_patch
    from sparserl_mcore.sync.diff import full_patch

    model, path = hf_model
    engine = _engine(path)
    prompt = _prompts(1)[0] * 2
    before = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0]
    assert engine.radix.num_pages > 0
    new = {n: t * 1.5 for n, t in engine.model.params.items() if n.endswith("v_proj.weight")}
    engine.update_weights(new, version=3)
    assert engine.radix.num_pages == 0 and engine.model_info()["weight_version"] == 3
    after = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0]
    assert (
        after.cached_prompt_tokens == 0
        and after.weight_version == 3
        and after.output_ids != before.output_ids
    )

    # A full sync patch back to the checkpoint's BF16 weights, applied + verified by sync's receiver.
    hf_state = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}
    hf_state = {n: t for n, t in hf_state.items() if n in engine.model.params}
    assert engine.apply_patch(encode_patch(full_patch(hf_state, version=4))) == 4
    torch.testing.assert_close(
        engine.model.params["model.norm.weight"], hf_state["model.norm.weight"].float()
    )
    # fp32 on CPU computes from input-major [in, out] fused q/k/v buffers: the patch restoring the
    # scaled v_proj must land in them
    qkv_in_out = engine.model.layers[1].qkv
    v_cols = slice(-engine.model.cfg.num_kv_heads * engine.model.cfg.head_dim, None)
    assert engine.model.input_major and qkv_in_out.is_contiguous()
    torch.testing.assert_close(
        qkv_in_out[:, v_cols].t(), hf_state["model.layers.1.self_attn.v_proj.weight"].float()
    )
    assert engine.radix.num_pages == 0


def test_fp32_engine_applies_every_fragment_of_a_version_it_receives_at_once(hf_model):
    """The trainer hands an in-process engine one version's per-rank fragments joined in one blob.
    An fp32 engine copies the tensors the fragments wrote from its BF16 wire state into its
    parameters: every fragment's tensors, not only the last one's (a stale tensor made the engine's
    policy drift from the learner's, step after step)."""
    from sparserl_mcore.sync.hashing import bits_view, dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment

    _, path = hf_model
    engine = _engine(path)
    assert engine.model.dtype == torch.float32
    wire = {n: t.to(torch.bfloat16).contiguous() for n, t in engine.model.params.items()}
    meta = ModelMeta(dtype_name(torch.bfloat16), {n: tuple(t.shape) for n, t in wire.items()})
    owners = ("model.norm.weight", "model.layers.1.mlp.down_proj.weight")  # one tensor per learner rank
    expected, fragments = {}, []
    for rank, name in enumerate(owners):
        new = wire[name].clone()
        flat = bits_view(new)
        idx = np.arange(0, flat.size, 3, dtype=np.int64)
        old = flat[idx].copy()
        flat[idx] = old + 1  # one ulp up
        expected[name] = new.float()
        change = [(name, idx, old, flat[idx].copy())]
        fragments.append(encode_fragment(change, meta, version=1, base_version=0, fragment=(rank, 2)))
    assert engine.apply_patch(b"".join(fragments)) == 1
    for name in owners:
        assert torch.equal(engine.model.params[name], expected[name]), name


def test_bf16_engine_applies_sparse_patch_in_place_and_rejects_bad_one(hf_model):
    """bf16 parameters ARE the sync target (fused q/k/v and gate/up rows are views): a sparse patch
    lands in place, verifies, and changes generation; a patch against the wrong base changes nothing."""
    from sparserl_mcore.sync.codec import encode_patch
    from sparserl_mcore.sync.diff import make_patch

    _, path = hf_model
    engine = _engine(path, dtype="bfloat16")
    old = {n: t.clone() for n, t in engine.model.params.items()}
    new = dict(old)
    new["model.layers.0.self_attn.k_proj.weight"] = old["model.layers.0.self_attn.k_proj.weight"] * 3
    new["model.layers.1.mlp.up_proj.weight"] = old["model.layers.1.mlp.up_proj.weight"].neg()
    patch = encode_patch(make_patch(old, new, version=1, base_version=0, anchor_version=0))
    prompt = _prompts(1)[0]
    before = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0]
    assert engine.apply_patch(patch) == 1
    fused_qkv = engine.model.layers[0].qkv
    assert fused_qkv.data_ptr() <= engine.model.params["model.layers.0.self_attn.k_proj.weight"].data_ptr()
    for name in new:
        assert torch.equal(engine.model.params[name], new[name]), name
    after = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0]
    assert after.output_ids != before.output_ids and after.cached_prompt_tokens == 0
    with pytest.raises(WeightVersionConflict, match="based on version 0"):
        engine.apply_patch(patch)
    for name in new:
        assert torch.equal(engine.model.params[name], new[name]), name


def test_stop_strings_with_the_checkpoint_tokenizer(tmp_path):
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    path = make_tiny(TinyModelConfig(arch="qwen3", vocab=128), tmp_path / "tiny")
    engine = _engine(path)
    prompt = engine.tokenizer.encode("2+2=")
    free = engine.generate([GenerateRequest(input_ids=prompt, sampling=GREEDY)])[0]
    text = engine.tokenizer.decode(free.output_ids)
    stop = text[6:8]
    first = next(
        i for i in range(1, len(free.output_ids) + 1) if stop in engine.tokenizer.decode(free.output_ids[:i])
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop], ignore_eos=True)
    stopped = engine.generate([GenerateRequest(input_ids=prompt, sampling=params)])[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[:first]
