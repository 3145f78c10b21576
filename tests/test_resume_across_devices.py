"""A checkpoint saved on a GPU resumes on CPU: the fixture was written on an H100 (NCCL, CUDA RNG
states, bf16 + fp32 master shards on the GPU); a CPU run over gloo must load it and train on.
The reverse (a CPU checkpoint resumed on the GPU) ran on the H100 too: docs/benchmarks.md, GPU."""

from __future__ import annotations

import shutil
from pathlib import Path

from e2e_support import metrics, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local

FIXTURE = Path(__file__).with_name("fixtures") / "h100_tp1_bf16"
TRAIN = str(Path(__file__).resolve().parents[1] / "launchers" / "train.py")


def test_an_h100_checkpoint_resumes_on_cpu(tmp_path):
    for part in ("tiny", "train.jsonl"):
        copy = shutil.copytree if (FIXTURE / part).is_dir() else shutil.copy
        copy(FIXTURE / part, tmp_path / part)
    ckpt = tmp_path / "h100" / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", ckpt)
    (ckpt / "latest").write_text("step_00000002")
    cfg = write_config(
        tmp_path,
        tmp_path / "tiny",
        "h100",
        model={"params_dtype": "bf16"},
        parallel={"tensor_model_parallel_size": 1},
        train={"micro_batch_size": 4, "steps": 3},
        checkpoint={"every": 1, "save_hf": None},
    )
    launch_local([TRAIN, "--config", str(cfg)], 1, env=subprocess_env(), timeout=600)
    records = metrics(tmp_path, "h100")
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == 2 and resumed[0]["rng"] == "restored", resumed
    assert "bf16 distributed optimizer" in resumed[0]["saved_layout"], resumed
    assert [r["step"] for r in records if "rollout/reward_mean" in r] == [3]
    assert (ckpt / "step_00000003").is_dir()
