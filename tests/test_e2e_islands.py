"""End to end on CPU: `sparserl train` with 2 DiLoCo islands of one rank each (PULSELoCo, H=3).

The demo-shaped loop makes 4 optimizer updates per RL step, so outer steps land mid step (after
updates 3, 6, 9, ...) and the engines, which only get agreed weights, lag the islands by up to
H-1 updates; the last step closes the open round. A second run starts from the first one's
step-2 checkpoint and must end with bit-identical HF weights; a resume with another island
count is refused before any rank starts, in one line.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from e2e_support import PY, REPO, make_assets, metrics, subprocess_env, write_config
from safetensors.torch import load_file

from sparserl_mcore.parallel.launch import launch_local

TRAIN = str(REPO / "launchers" / "train.py")
ISLANDS = {"parallel": {"tensor_model_parallel_size": 1, "islands": 2}, "diloco": {"inner_steps": 3}}


def _weights(hf_dir):
    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.timeout(600)
def test_islands_train_resume_bit_identically_and_refuse_another_island_count(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    full = write_config(tmp_path, hf, "full", **ISLANDS)
    launch_local([TRAIN, "--config", str(full)], 2, env=env, timeout=300)
    rows = metrics(tmp_path, "full")
    outer = [r for r in rows if r.get("event") == "diloco_outer_step"]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert len(steps) == 4 and [r["diloco/outer_step"] for r in outer] == [1, 2, 3, 4, 5, 6]  # 16 updates
    assert all(r["train/updates"] == 4 for r in steps)
    assert all(0 < r["diloco/density"] <= 1 and r["diloco/bytes_per_entry"] < 12 for r in outer)
    # rollouts come from the last agreed weights: steps 2 and 3 start 1 and 2 updates behind
    assert [r["rollout/policy_lag_updates"] for r in steps] == [0, 1, 2, 0]
    assert steps[-1]["diloco/inner_since_outer"] == 0  # the last step closed the round
    placed = next(r for r in rows if r.get("event") == "islands")
    assert placed["island 0"].startswith("ranks 0-0 on ") and placed["island 1"].startswith("ranks 1-1 on ")

    resumed = _from_step2(tmp_path, hf, "resumed", ISLANDS)
    launch_local([TRAIN, "--config", str(resumed)], 2, env=env, timeout=300)
    a, b = _weights(tmp_path / "full" / "hf"), _weights(tmp_path / "resumed" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = [r for r in metrics(tmp_path, "resumed") if "rollout/reward_mean" in r]
    assert [r["rollout/reward_mean"] for r in again] == [r["rollout/reward_mean"] for r in steps[2:]]

    one = _from_step2(tmp_path, hf, "one_island", {"parallel": {"tensor_model_parallel_size": 1}})
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(one), "--nproc", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "set parallel.islands=2" in lines[0], proc.stderr


def _from_step2(root, hf, name: str, sections: dict):
    """A run config `name` whose checkpoint directory holds the full run's step-2 checkpoint."""
    cfg = write_config(root, hf, name, **sections)
    ckpt = root / name / "ckpt"
    ckpt.mkdir(parents=True)
    shutil.copytree(root / "full" / "ckpt" / "step_00000002", ckpt / "step_00000002")
    (ckpt / "latest").write_text("step_00000002\n")
    return cfg
