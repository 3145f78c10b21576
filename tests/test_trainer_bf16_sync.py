"""The trainer's bf16 path on CPU: bf16 params with fp32 master weights in megatron's distributed
optimizer (the GPU default), and the sparse sync reading those BF16 params directly.

Before the fix the local spec's norms stayed fp32 in a bf16 model and the trainer's sync refused
them ("sync handles bfloat16, float16 weights, got torch.float32"). Here the trainer's own
learner and `WeightSyncer` (tests/bf16_sync_worker.py, TP=2 over gloo) drive two RL updates and
sparse syncs into a real bf16 embedded engine, which must end bit-identical to a dense HF export.
"""

from __future__ import annotations

import json
import pathlib

from e2e_support import make_assets, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("bf16_sync_worker.py"))


def test_bf16_learner_syncs_bit_identically_into_a_bf16_engine(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(tmp_path, hf, "bf16", train={"micro_batch_size": 4})
    launch_local([WORKER, str(cfg), str(tmp_path)], 2, env=subprocess_env(), timeout=300)
    found = json.loads((tmp_path / "result.json").read_text())
    assert found["learner_dtypes"] == ["torch.bfloat16"], found
    assert found["optimizers"] == ["DistributedOptimizer"], found
    assert found["updates"] == [2.0, 2.0], found  # train.reuse_epochs=2, nothing gated or skipped
    assert all(b > 0 for b in found["patch_bytes"]), found
    assert "sync_fallback_full" not in found["events"], found  # every patch verified on the engine
    assert found["engine_version"] == 2
    assert found["names_equal"] and found["export_dtypes"] == ["torch.bfloat16"], found
    assert found["mismatched"] == [], found
    assert found["changed_vs_base"] > 0, found  # the updates moved weights, so equality means something
