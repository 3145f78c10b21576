"""In-flight weight updates (asynchronous RL) in the embedded engine and `sparserl serve`: a sparse
patch lands between two decode steps while requests run. They finish without a restart or a second
prefill, keep their KV, and every token names the version that sampled it. The log-probs after the
switch equal HF transformers continuing, under the new weights, from the KV cache the old weights
computed (PipelineRL's semantics); the engine's weights equal the learner's BF16 ones bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from hf_reference import tiny_qwen2
from waiting import wait_until

from sparserl_mcore.rollout.client import RemoteEngine
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.diff import make_patch

VOCAB = 160
TOKEN = "inflight-test-token"
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 saved in BF16: the fp32 engine then holds exactly the learner's BF16 values."""
    path = tmp_path_factory.mktemp("qwen2-bf16")
    tiny_qwen2(path, VOCAB, torch.bfloat16)
    return path


def _engine(path, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(path, EngineConfig(device="cpu", page_size=4, capacity_pages=512, **kw))


def _learner_step(engine: EmbeddedEngine) -> tuple[dict[str, torch.Tensor], bytes]:
    """The learner's BF16 weights after one update touching about 1 % of the elements, and the
    sparse patch from the engine's version 0 to them."""
    old = {n: t.to(torch.bfloat16) for n, t in engine.model.params.items()}
    assert all(torch.equal(t.float(), engine.model.params[n]) for n, t in old.items())
    g = torch.Generator().manual_seed(7)
    new = {}
    for name, t in old.items():
        hit = torch.rand(t.shape, generator=g) < 0.01
        new[name] = torch.where(hit, t + 0.05 * torch.randn(t.shape, generator=g).to(t.dtype), t)
    return new, encode_patch(make_patch(old, new, version=1, base_version=0, anchor_version=0))


def _prompts(n: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, VOCAB - 1, (5 + 3 * i,), generator=g).tolist()) for i in range(n)]


def _requests(prompts) -> list[GenerateRequest]:
    params = [SamplingParams(**{**SAMPLED.__dict__, "seed": 100 + i}) for i in range(len(prompts))]
    return [
        GenerateRequest(input_ids=p, sampling=sp, rid=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


def _generate_in_background(engine, requests) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(samples=engine.generate(requests)), daemon=True)
    thread.start()
    return thread, out


def _hf_logprobs_across_the_switch(hf_dir, new_weights, sample) -> torch.Tensor:
    """HF transformers: the tokens before the switch under the old weights, then, continuing from
    the KV cache those computed, the rest under the new weights (the engine's step that samples the
    first new-version token feeds the last old-version token through the new weights)."""
    model = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    k = sample.output_versions.index(1)
    seq = torch.tensor([list(sample.prompt_ids) + list(sample.output_ids)])
    p = len(sample.prompt_ids)
    with torch.no_grad():
        first = model(seq[:, : p + k - 1], use_cache=True)
        model.load_state_dict({n: t.float() for n, t in new_weights.items()}, strict=False)
        rest = model(seq[:, p + k - 1 : -1], past_key_values=first.past_key_values)
    logits = torch.cat([first.logits[0, p - 1 :], rest.logits[0]])
    return torch.log_softmax(logits, dim=-1).gather(1, seq[0, p:, None])[:, 0]


def test_a_patch_lands_between_decode_steps_and_every_request_keeps_its_kv(hf_dir):
    engine = _engine(hf_dir, check_invariants=True)
    learner, patch = _learner_step(engine)
    prompts = _prompts(6)
    thread, out = _generate_in_background(engine, _requests(prompts))
    wait_until(lambda: engine.stats()["generated_tokens"] >= 6 * 8, timeout=60, what="decoding")
    steps_before = engine.stats()["generated_tokens"] / 6  # all six decode in every step
    assert engine.apply_patch(patch) == 1
    thread.join(120)
    samples = out["samples"]
    stats = engine.stats()
    # every request finished, none restarted, none prefilled again
    assert [s.finish_reason for s in samples] == ["length"] * 6
    assert stats["retractions"] == 0 and stats["prefill_tokens"] == sum(map(len, prompts))
    # the engine holds the learner's BF16 weights exactly
    for name, value in learner.items():
        assert torch.equal(engine.model.params[name], value.float()), name
    # versions: per token, monotone, both present in the requests the update landed in
    switched = [s for s in samples if set(s.output_versions) == {0, 1}]
    assert len(switched) == 6, [s.output_versions[:3] for s in samples]
    # ... and it landed at the next step boundary or so, not after the decode loop let it in
    late = max(list(s.output_versions).count(0) for s in samples) - steps_before
    assert late <= 8, f"the patch landed {late:.0f} decode steps after apply_patch was called"
    for s in samples:
        assert list(s.output_versions) == sorted(s.output_versions) and s.weight_version == 1
    assert engine.last_pause_ms is not None and engine.last_pause_ms > 0
    # the KV computed before the switch was kept: HF continuing from the old cache agrees
    for s in switched[:2]:
        reference = _hf_logprobs_across_the_switch(hf_dir, learner, s)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), reference, rtol=0, atol=2e-4)


def test_new_requests_reuse_no_prefix_kv_of_an_older_version_unless_configured(hf_dir):
    prompt = _prompts(1)[0] * 3  # whole cached pages
    short = GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=2))
    for across, expect_hit in ((False, False), (True, True)):
        engine = _engine(hf_dir, prefix_cache_across_versions=across)
        _, patch = _learner_step(engine)
        engine.generate([short])
        engine.apply_patch(patch)
        after = engine.generate([short])[0]
        assert (after.cached_prompt_tokens > 0) == expect_hit, across


def test_serve_pause_in_place_patch_continue_keeps_requests_running(hf_dir):
    """The trainer's in-flight bracket against `sparserl serve`: pause in place, one fragment per
    learner rank, continue. The request finishes, its tokens name both versions over HTTP, and the
    server reports how long generation stood still."""
    engine = _engine(hf_dir)
    learner, patch = _learner_step(engine)
    app = create_app(engine, ServerConfig(token=TOKEN, max_concurrent_batches=2))
    long = SamplingParams(**{**SAMPLED.__dict__, "max_new_tokens": 400, "seed": 3})
    with BackgroundServer(app) as server, RemoteEngine(server.url, TOKEN, timeout=120) as remote:
        thread, out = _generate_in_background(remote, [GenerateRequest(input_ids=(5, 6, 7), sampling=long)])
        wait_until(lambda: engine.stats()["generated_tokens"] >= 8, timeout=60, what="decoding")
        remote.pause("in_place")
        assert remote.apply_patch(patch) == 1 and remote.last_pause_ms is None  # inside the pause
        remote.resume()
        thread.join(120)
    sample = out["samples"][0]
    assert sample.finish_reason == "length" and len(sample.output_ids) == 400
    assert sample.output_versions[0] == 0 and sample.output_versions[-1] == 1
    assert list(sample.output_versions) == sorted(sample.output_versions)
    assert remote.last_pause_ms is not None and remote.last_pause_ms > 0
    assert engine.stats()["retractions"] == 0
    for name, value in learner.items():
        assert torch.equal(engine.model.params[name], value.float()), name
