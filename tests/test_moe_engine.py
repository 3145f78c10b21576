"""The embedded engine serving mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert):
its model's logits against HF transformers, greedy generation against HF `generate`, and sparse
updates by HF expert name reaching the packed expert operands the forward uses."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_reference import hf_greedy

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.engine.hf_model import CausalLM
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
VOCAB = 160


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("moe_engine")
    return {
        "qwen3_moe": make_tiny(
            TinyModelConfig(arch="qwen3_moe", vocab=VOCAB, experts=8, seed=21), root / "q3"
        ),
        "qwen2_moe": make_tiny(TinyModelConfig(arch="qwen2_moe", vocab=VOCAB, seed=22), root / "q2"),
    }


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_logits_match_hf_transformers(checkpoints, arch):
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    model = CausalLM.from_pretrained(checkpoints[arch])
    sink: list = []
    model.record_routing(sink)
    got = model.forward_reference(ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert (
        len(sink) == 1 and len(sink[0]) == 2 and sink[0][0].shape == (40, 2)
    )  # one forward, 2 layers, top-2


def test_greedy_matches_hf_generate(checkpoints):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["qwen3_moe"], dtype=torch.float32
    ).eval()
    engine = EmbeddedEngine(
        checkpoints["qwen3_moe"], EngineConfig(device="cpu", page_size=4, capacity_pages=128)
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 17, 8)]
    samples = engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in prompts])
    for prompt, sample in zip(prompts, samples, strict=True):
        assert list(sample.output_ids) == hf_greedy(hf, prompt, GREEDY.max_new_tokens)


def test_expert_updates_by_hf_name_reach_the_forward(checkpoints):
    model = CausalLM.from_pretrained(checkpoints["qwen2_moe"])
    ids = torch.arange(30) % VOCAB
    before = model.forward_reference(ids)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    live = model.params[name]
    model.update({name: torch.zeros_like(live)})
    assert model.params[name] is live and bool((live == 0).all())
    assert torch.equal(model.layers[1].moe.down[2], torch.zeros_like(model.layers[1].moe.down[2]))
    model.update({"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 64)})
    assert not torch.allclose(model.forward_reference(ids), before)


def _hf_routing(hf, ids: list[int], top_k: int) -> torch.Tensor:
    """HF transformers' expert choices for `ids`: the router logits' top-k per layer, [T, L, k] sorted."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([lg.topk(top_k, dim=-1).indices for lg in out.router_logits], dim=1).sort(-1).values


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_routed_experts_equal_hf_routing(checkpoints, arch):
    """R3's sampler side: the ids the engine returns are HF's routing of the same tokens, for the
    positions [routed_experts_start, seqlen - 1); a prompt prefix served from the radix cache starts
    the range after it (routed by the earlier request, not misattributed to this one)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    engine = EmbeddedEngine(checkpoints[arch], EngineConfig(device="cpu", page_size=4, capacity_pages=128))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 6)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=5)
    first = engine.generate([GenerateRequest(input_ids=prompts[0], sampling=sp, return_routed_experts=True)])
    rest = engine.generate(
        [GenerateRequest(input_ids=p, sampling=sp, return_routed_experts=True) for p in prompts]
        + [GenerateRequest(input_ids=prompts[1], sampling=sp)]
    )
    samples = first + rest
    assert [s.routed_experts_start for s in samples[:3]] == [0, 8, 8]  # two cached pages of 4
    assert samples[3].routed_experts is None
    for s in samples[:3]:
        seq = list(s.prompt_ids + s.output_ids)
        want = _hf_routing(hf, seq[:-1], top_k=2)[s.routed_experts_start :]
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.int16
        assert s.routed_experts.shape == (len(seq) - 1 - s.routed_experts_start, 2, 2)
        assert torch.equal(s.routed_experts.sort(-1).values.long(), want)


def test_routed_experts_refused_on_a_dense_model(tmp_path):
    dense = make_tiny(TinyModelConfig(arch="qwen3", vocab=VOCAB, seed=2), tmp_path / "dense")
    engine = EmbeddedEngine(dense, EngineConfig(device="cpu", page_size=4, capacity_pages=16))
    with pytest.raises(ValueError, match="return_routed_experts: qwen3 is a dense model"):
        engine.generate([GenerateRequest(input_ids=[1, 2, 3], sampling=GREEDY, return_routed_experts=True)])


def test_routed_experts_over_http_as_sglang_returns_them(checkpoints, caplog):
    """`sparserl serve` returns meta_info["routed_experts"] as SGLang does (base64 int32, read
    with SGLang's `extract_routed_experts_from_meta_info` decoding), `RemoteEngine` reads them
    back equal to the in-process engine's; a payload that does not fit its sample is refused."""
    import base64

    import httpx
    import numpy as np

    from sparserl_mcore.rollout.client import RemoteEngine
    from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
    from sparserl_mcore.rollout.http.wire import read_sample

    cfg = EngineConfig(device="cpu", page_size=4, capacity_pages=128, radix_cache=False)
    local = EmbeddedEngine(checkpoints["qwen3_moe"], cfg)
    served = EmbeddedEngine(checkpoints["qwen3_moe"], cfg)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=9)
    reqs = [
        GenerateRequest(input_ids=p, sampling=sp, rid=f"r{i}", return_routed_experts=True)
        for i, p in enumerate(([3, 1, 4, 1, 5], [9, 2, 6]))
    ]
    want = local.generate(reqs)
    with BackgroundServer(create_app(served, ServerConfig())) as server:
        raw = httpx.post(
            f"{server.url}/generate",
            json={
                "input_ids": [3, 1, 4, 1, 5],
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "seed": 9},
                "return_routed_experts": True,
            },
            timeout=120,
        ).json()
        with RemoteEngine(server.url, routed_experts_shape=(2, 2)) as remote:
            got = remote.generate(reqs)
    flat = np.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), dtype=np.int32)
    assert flat.size == (5 + 6 - 1) * 2 * 2 and raw["meta_info"]["routed_experts_start_len"] == 0
    assert torch.equal(torch.from_numpy(flat.copy()).view(-1, 2, 2), want[0].routed_experts.int())
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids and g.routed_experts_start == w.routed_experts_start
        assert g.routed_experts is not None and torch.equal(g.routed_experts, w.routed_experts)
    raw["meta_info"]["routed_experts"] = base64.b64encode(flat[:-4].tobytes()).decode()  # a row short
    raw["meta_info"]["output_token_logprobs"] = [[0.0, t, None] for t in raw["output_ids"]]
    short = read_sample(raw, reqs[0], (2, 2))
    assert short.routed_experts is None and "routed_experts refused: 36 ids" in caplog.text


def test_routed_experts_survive_kv_compression_and_batching(checkpoints):
    """Compression evicts KV, not routing records: every fed token keeps its row. Requests decoded
    together (rows handed out per request from one mixed forward) return what each returns alone,
    and the prompt rows (routed before any compression) are HF's routing."""
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

    kv = KVCompressionConfig(method="snapkv", budget=8, interval=2, window=2, sink_tokens=2)
    cfg = EngineConfig(device="cpu", page_size=4, capacity_pages=128, radix_cache=False, kv_compression=kv)
    engine = EmbeddedEngine(checkpoints["qwen3_moe"], cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["qwen3_moe"], dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=2)
    reqs = [
        GenerateRequest(input_ids=torch.randint(0, VOCAB, (n,), generator=g).tolist(), sampling=sp,
                        return_routed_experts=True)
        for n in (5, 11, 7)
    ]  # fmt: skip
    together = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    for t, a in zip(together, alone, strict=True):
        assert t.kv_stats.compressions > 0 and t.output_ids == a.output_ids
        assert t.routed_experts is not None and a.routed_experts is not None
        assert t.routed_experts.shape[0] == len(t.prompt_ids) + len(t.output_ids) - 1
        assert torch.equal(t.routed_experts, a.routed_experts)
        n = len(t.prompt_ids)
        want = _hf_routing(hf, list(t.prompt_ids), top_k=2)
        assert torch.equal(t.routed_experts[:n].sort(-1).values.long(), want)
