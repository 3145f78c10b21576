"""End to end on CPU: `sparserl train` on a tiny Qwen3-MoE at EP=2 (2 gloo processes).

The whole product path with experts: the embedded engine serving the MoE policy and returning the
experts it routed, the megatron learner with expert parallelism and the aux loss replaying them
(rollout routing replay), sparse syncs of expert weights into the engine,
routing telemetry (metrics and the per-step table), a checkpoint and the HF export. Resuming at
another EP is tests/test_moe_train.py's (equal to the uninterrupted run).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from e2e_support import PY, REPO, metrics, subprocess_env, write_config

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

pytestmark = pytest.mark.timeout(900)


def test_train_at_ep2(tmp_path):
    hf = make_tiny(
        TinyModelConfig(arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2), tmp_path / "moe"
    )
    prompts = [{"prompt": f"say {i}:", "answer": "a"} for i in range(64)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    cfg = write_config(
        tmp_path,
        hf,
        "run",
        model={
            "hf_path": str(hf),
            "params_dtype": "bf16",
            "moe": {"aux_loss_coeff": 0.01, "routing_replay": True},
        },
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
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [r for r in metrics(tmp_path, "run") if "moe/load_imbalance" in r]
    assert len(rows) == 2 and all(r["moe/aux_loss"] > 0 and r["sync/patch_bytes"] > 0 for r in rows)
    assert all(r["moe/replayed_tokens"] > 0 and r["moe/replay_refused_samples"] == 0 for r in rows)
    table = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics" / "moe_routing.jsonl").read_text().splitlines()
    ]
    assert [t["step"] for t in table] == [1, 2] and len(table[0]["tokens_per_expert"]) == 2
    assert (tmp_path / "run" / "ckpt" / "step_00000002" / "run.json").is_file()
    # the HF export holds every expert whole, gathered over the EP ranks
    index = json.loads((tmp_path / "run" / "hf" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
