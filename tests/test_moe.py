"""Mixture-of-experts (Qwen3-MoE, Qwen2-MoE with its shared expert) on real megatron-core over gloo.

One 4-rank torchrun (tests/moe_worker.py) runs three layouts: TP=2 x EP=2 (all-to-all dispatcher,
sequence parallel), EP=4 loaded from the dist checkpoint the first layout converted (all-gather
dispatcher, experts resharded), PP=2 x EP=2. Each matches HF transformers' logits in fp32; the
checkpoint converted at TP=2 x EP=2 and exported at EP=4 equals the source bit for bit.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("moe_worker.py"))
CHECKPOINTS = {
    "qwen3_moe": TinyModelConfig(arch="qwen3_moe", vocab=200, head_dim=24, seed=11),
    "qwen2_moe_tied": TinyModelConfig(arch="qwen2_moe", vocab=200, tie_embeddings=True, seed=12),
}
TOLERANCE = 1e-5
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_tiny(cfg, root / name) for name, cfg in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def moe_run(hf_dirs, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    out = tmp_path_factory.mktemp("moe_run")
    launch_local([WORKER, str(out), *map(str, hf_dirs.values())], 4, env=CPU_ONLY, timeout=900)
    merged: dict[str, dict] = {}
    for rank_file in sorted(out.glob("rank*.json")):
        for layout, found in json.loads(rank_file.read_text()).items():
            merged.setdefault(layout, {}).update(found)
    return out, merged


@pytest.mark.parametrize(("layout", "local_experts"), [("tp2_ep2", 2), ("ep4_from_dist", 1), ("pp2_ep2", 2)])
def test_logits_match_hf_transformers(moe_run, layout, local_experts):
    results = moe_run[1][layout]
    assert sorted(results) == sorted(CHECKPOINTS)
    for name, found in results.items():
        assert found["shape"] == [4, 15, 200], name
        assert found["local_experts"] == local_experts, (name, found)  # experts really split over EP
        assert found["max_rel"] < TOLERANCE, f"{name} at {layout}: {found}"


def test_conversion_reshards_experts_bit_exactly(moe_run, hf_dirs):
    out = moe_run[0]
    for name, src in hf_dirs.items():
        want = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
        got = {
            k: v
            for f in sorted((out / f"export_{name}").glob("*.safetensors"))
            for k, v in load_file(f).items()
        }
        assert sorted(got) == sorted(want), name
        assert any(".mlp.experts.3.down_proj" in k for k in got)
        for key, tensor in want.items():
            assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), f"{name}: {key} differs"
