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
