"""The engine's HF forward against HF transformers itself (fp32 logits within 1e-4 relative)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.rollout.engine.hf_model import CausalLM

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # < sequence length, so the scaling matters
    "rope_theta": 500000.0,
}
CASES = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(tie_word_embeddings=True, **COMMON)
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=24, **COMMON)),
    "llama3": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(rope_parameters=LLAMA3_ROPE, **COMMON)
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_transformers(case, tmp_path):
    torch.manual_seed(0)
    hf = CASES[case]().eval()
    with torch.no_grad():  # HF initialises biases and norms to constants; make them matter
        for name, p in hf.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # sharded: exercises the index file
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, COMMON["vocab_size"], (70,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    ours = CausalLM.from_pretrained(tmp_path).forward_reference(ids)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{case}: max relative logit error {rel:.2e}"


def test_update_in_place_and_bad_weights(tmp_path):
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).save_pretrained(tmp_path)
    model = CausalLM.from_pretrained(tmp_path)
    live = model.params["model.norm.weight"]
    model.update({"model.norm.weight": torch.full_like(live, 2.0)})
    assert model.params["model.norm.weight"] is live and bool((live == 2.0).all())
    with pytest.raises(ValueError, match="not a parameter"):
        model.update({"model.nope": live})
    with pytest.raises(ValueError, match="floating-point"):
        model.update({"model.norm.weight": torch.ones_like(live, dtype=torch.int32)})
    with pytest.raises(ValueError, match="shape"):
        model.update({"model.norm.weight": torch.zeros(3)})
    params = dict(model.params)
    del params["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        CausalLM(model.cfg, params, device="cpu", dtype=torch.float32)


def test_config_rejects_unsupported(tmp_path):
    """The engine reads the project's one HF config reader: unsupported models never load."""
    base = {**COMMON, "model_type": "qwen2", "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="model_type='mistral'"):
        parse_hf_config({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported for qwen2"):
        parse_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        parse_hf_config({**base, "use_sliding_window": True})
    (tmp_path / "config.json").write_text(json.dumps({**base, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        CausalLM.from_pretrained(tmp_path)
