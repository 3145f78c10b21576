"""End to end on CPU: `sparserl train` on a tiny Qwen3-MoE at EP=2 (2 gloo processes), then resumed
at EP=1 from its checkpoint.

The whole product path with experts: the embedded engine serving the MoE policy, the megatron
learner with expert parallelism and the aux loss, sparse syncs of expert weights into the engine,
routing telemetry (metrics and the per-step table), checkpoints, the HF export, and the launcher
noting the changed layout before the resumed run reshards weights and optimizer state.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from e2e_support import PY, REPO, metrics, subprocess_env, write_config

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

pytestmark = pytest.mark.timeout(900)


def test_train_at_ep2_then_resume_at_ep1(tmp_path):
    hf = make_tiny(
        TinyModelConfig(arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2), tmp_path / "moe"
    )
    rows = [{"prompt": f"say {i}:", "answer": "a"} for i in range(64)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(
        tmp_path,
        hf,
        "run",
        model={"hf_path": str(hf), "params_dtype": "bf16", "moe": {"aux_loss_coeff": 0.01}},
        parallel={"tensor_model_parallel_size": 1, "expert_model_parallel_size": 2},
        train={
            "steps": 2,
            "prompts_per_step": 4,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "reuse_epochs": 2,
        },
    )
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}

    def train(*argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done

    train("--nproc", "2")
    rows = [r for r in metrics(tmp_path, "run") if "moe/load_imbalance" in r]
    assert len(rows) == 2 and all(r["moe/aux_loss"] > 0 and r["sync/patch_bytes"] > 0 for r in rows)
    table = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics" / "moe_routing.jsonl").read_text().splitlines()
    ]
    assert [t["step"] for t in table] == [1, 2] and len(table[0]["tokens_per_expert"]) == 2

    resumed = train("--nproc", "1", "parallel.expert_model_parallel_size=1", "train.steps=3")
    assert "expert_model_parallel_size 2 -> 1" in resumed.stdout + resumed.stderr
    steps = [r["step"] for r in metrics(tmp_path, "run") if "moe/load_imbalance" in r]
    assert steps == [1, 2, 3]
    index = json.loads((tmp_path / "run" / "hf" / "model.safetensors.index.json").read_text())
    assert (
        "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
    )  # the HF export, experts whole
