"""The static decode step (rollout/engine/decode_graphs.py), the region CUDA graphs capture, on CPU.

- run eagerly with padded rows, it gives the live rows the logits of `BatchForward`'s eager gather
  path bit for bit (bf16: no native kernel on either side) and writes the same K/V, touching no
  page but the live rows' slots and the reserved scratch page;
- nothing in it reads a value back to the host (a sanitizer makes every host read raise there);
- the host work around it (prepare + greedy sampling) dispatches few ops: with the replay, <= 60;
- an engine with it on generates what an engine without it does (bf16: bitwise; fp32: HF greedy),
  and steps that compression feeds (H2O, SnapKV) stay eager.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy, tiny_qwen2
from host_syncs import count_ops, forbid_host_syncs

from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.engine.batch_forward import BatchForward
from sparserl_mcore.rollout.engine.decode_graphs import batch_buckets, context_buckets
from sparserl_mcore.rollout.engine.sampler import sample
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

VOCAB = 96
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return tiny_qwen2(path, VOCAB), path


def _engine(path, **kw) -> EmbeddedEngine:
    kw.setdefault("page_size", 4)
    kw.setdefault("capacity_pages", 128)
    kw.setdefault("cuda_graph_max_context", 64)
    return EmbeddedEngine(path, EngineConfig(device="cpu", **kw))


def _prompts(n: int, lengths=(5, 11, 17, 8)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _decoding(engine: EmbeddedEngine, n: int):
    """n requests admitted and prefilled by one scheduler step, their next slots reserved: what
    a decode step's forward receives."""
    states = [engine._new_state(GenerateRequest(input_ids=p, sampling=GREEDY)) for p in _prompts(n)]
    engine.scheduler.waiting.extend(states)
    engine.scheduler.step()
    decodes = engine.scheduler._reserve_decode_slots()
    assert decodes == states and all(s.n_cached > 0 and not s.done for s in states)
    return decodes


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert context_buckets(16, 4096) == [256, 512, 1024, 2048, 4096]
    assert context_buckets(16, 100) == [112]  # whole pages


def test_static_step_equals_the_eager_gather_path_and_touches_only_its_slots(hf_model):
    _, path = hf_model
    engine = _engine(path, dtype="bfloat16", cuda_graph=True)
    graphs = engine.scheduler._forward.graphs
    assert graphs is not None
    decodes = _decoding(engine, 3)  # bucket of 4 rows: one padded row
    pool = engine.pool
    k0, v0 = pool.k.clone(), pool.v.clone()

    with torch.inference_mode():
        rows, width = graphs.prepare(decodes)
        assert (rows, width) == (4, 64)
        static_logits = graphs.decode_step(rows, width)[:3]
        k_static, v_static = pool.k.clone(), pool.v.clone()
        pool.k.copy_(k0)
        pool.v.copy_(v0)
        eager = BatchForward(engine.model, pool, KVCompressionConfig(), None, None)
        eager_logits = eager(decodes, [])

    assert torch.equal(static_logits, eager_logits)
    live = [p for p in range(pool.num_pages) if p != graphs.scratch]
    assert torch.equal(k_static[:, live], pool.k[:, live]) and torch.equal(v_static[:, live], pool.v[:, live])
    changed = (k_static != k0).flatten(2).any(-1).any(0)  # [pages]: pages the static step wrote
    written = {r.pages[(r.n_cached - 1) // pool.page_size] for r in decodes}  # counters advanced
    assert set(changed.nonzero().flatten().tolist()) <= written | {graphs.scratch}


def test_no_host_sync_inside_the_static_step_and_few_ops_around_it(hf_model):
    _, path = hf_model
    engine = _engine(path, cuda_graph=True)
    graphs = engine.scheduler._forward.graphs
    decodes = _decoding(engine, 5)
    with torch.inference_mode():
        with count_ops() as around:
            key = graphs.prepare(decodes)
        with forbid_host_syncs(), count_ops() as inside:
            logits = graphs.decode_step(*key)[: len(decodes)]
        with count_ops() as sampling:
            sample(logits, [r.req.sampling for r in decodes], [r.generator for r in decodes])
        # the sanitizer is live: a host read in the region raises
        with pytest.raises(RuntimeError, match="host sync"), forbid_host_syncs():
            bool(logits.isnan().any())
    per_step = around.total + 1 + sampling.total  # prep, one replay, the sampler
    print(f"ops per decode step: prep {around.total} + replay 1 + sampler {sampling.total} = {per_step}")
    print(f"ops inside the captured region: {inside.total} ({engine.model.cfg.num_layers} layers)")
    assert per_step <= 60, (around.counts, sampling.counts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_with_the_static_step_generates_what_one_without_does(hf_model, dtype):
    model, path = hf_model
    requests = [GenerateRequest(input_ids=p, sampling=GREEDY) for p in _prompts(6)]
    on = _engine(path, dtype=dtype, cuda_graph=True, check_invariants=True)
    off = _engine(path, dtype=dtype, cuda_graph=False)
    got, want = on.generate(requests), off.generate(requests)
    assert on.scheduler._forward.static_steps > 0 and off.scheduler._forward.graphs is None
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids
        # the same math; bf16 GEMMs over a padded row count (and fp32's native C kernel on the
        # eager side) sum in another order, so the log-probs agree to the dtype's rounding
        tol = {"bfloat16": 2e-2, "float32": 1e-5}[dtype]
        lp_a, lp_b = torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs)
        torch.testing.assert_close(lp_a, lp_b, atol=tol, rtol=tol)
    if dtype == "float32":
        for req, s in zip(requests, got, strict=True):
            assert list(s.output_ids) == hf_greedy(model, list(req.input_ids), GREEDY.max_new_tokens)
    assert on.health_problem() is None
    on.flush_cache()
    assert on.pool.num_free == on.pool.num_pages - 1  # the scratch page stays reserved


def test_rows_that_change_requests_read_their_new_requests_pages(hf_model):
    """The page tables persist between steps and a row is rewritten only when its request or its
    pages changed: requests finishing at different steps shift the others into new rows (with the
    same page counts as the row's old request), and late admissions take the freed rows."""
    _, path = hf_model
    requests = [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=3 + 5 * (i % 4), ignore_eos=True),
        )
        for i, p in enumerate(_prompts(10, lengths=(5, 6, 7, 8)))
    ]
    on = _engine(path, cuda_graph=True, max_running_requests=6, check_invariants=True)
    off = _engine(path, cuda_graph=False, max_running_requests=6)
    got, want = on.generate(requests), off.generate(requests)
    assert on.scheduler._forward.static_steps > 0
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    torch.testing.assert_close(
        torch.tensor([lp for s in got for lp in s.output_logprobs]),
        torch.tensor([lp for s in want for lp in s.output_logprobs]),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize(("method", "static"), [("h2o", False), ("snapkv", False), ("streamingllm", True)])
def test_compression_that_needs_attention_data_stays_eager(hf_model, method, static):
    _, path = hf_model
    kv = KVCompressionConfig(method=method, budget=16, interval=4, window=4, sink_tokens=2)
    engine = _engine(path, cuda_graph=True, kv_compression=kv)
    engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in _prompts(3)])
    assert (engine.scheduler._forward.static_steps > 0) is static


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="cuda_graph_max_bs=0"):
        EngineConfig(cuda_graph_max_bs=0)
