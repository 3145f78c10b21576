"""End to end on CPU: `sparserl train` over uneven pipeline stages (3 layers on PP=2) over 2 gloo
processes, with the sparse weight sync every step, and a resume from the step-1 checkpoint at the
other uneven split of the same layers: both runs end with bit-identical HF weights.

Gradient clipping is off here: the global grad norm sums per-stage partial sums, so another split
rounds it differently in the last bit and clipping would carry that into every weight.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config
from safetensors.torch import load_file

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

TRAIN = str(REPO / "launchers" / "train.py")


def _weights(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.timeout(420)
def test_uneven_pp2_trains_syncs_and_resumes_at_another_split_bit_identically(tmp_path):
    make_assets(tmp_path)
    hf = make_tiny(TinyModelConfig(arch="qwen2", layers=3, tie_embeddings=True), tmp_path / "tiny3")
    env = subprocess_env()
    pp2 = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
    short = {"steps": 2}
    no_clip = {"lr": 3e-3, "weight_decay": 0.0, "clip_grad": 0.0}
    # the default split of 3 layers over 2 stages is (2, 1)
    full = write_config(
        tmp_path, hf, "full", parallel=pp2, train=short, checkpoint={"every": 1}, optimizer=no_clip
    )
    launch_local([TRAIN, "--config", str(full)], 2, env=env, timeout=300)
    records = metrics(tmp_path, "full")
    assert [r["sync/patch_bytes"] > 0 for r in records if "sync/patch_bytes" in r] == [True, True]
    assert not any(r.get("event") == "sync_fallback_full" for r in records), records

    # resume from the step-1 checkpoint with the layers split (1, 2) instead
    resumed_ckpt = tmp_path / "resumed" / "ckpt"
    resumed_ckpt.mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "ckpt" / "step_00000001", resumed_ckpt / "step_00000001")
    (resumed_ckpt / "latest").write_text("step_00000001\n")
    other_split = {**pp2, "num_layers_in_first_pipeline_stage": 1}
    resumed = write_config(tmp_path, hf, "resumed", parallel=other_split, train=short, optimizer=no_clip)
    launch_local([TRAIN, "--config", str(resumed)], 2, env=env, timeout=300)
    records = metrics(tmp_path, "resumed")
    assert [r["step"] for r in records if r.get("event") == "resumed"] == [1]
    assert not any(r.get("event") == "sync_fallback_full" for r in records), records

    a, b = _weights(tmp_path / "full" / "hf"), _weights(tmp_path / "resumed" / "hf")
    assert a.keys() == b.keys() and "model.layers.2.mlp.down_proj.weight" in a
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
