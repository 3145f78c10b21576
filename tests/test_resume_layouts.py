"""Training checkpoints resume across TP / PP / DP layouts and params dtypes, or are refused first.

One 2-rank launch (tests/resume_worker.py, gloo) saves the trainer's learner after two RL updates
at TP=2 fp32 with megatron's distributed optimizer, then loads it at PP=2 bf16 and at TP=1 DP=2
fp32. The fp32 master weights and both Adam moments, gathered into HF coordinates independently
of megatron's checkpoint code, must come back bit for bit; the params must be the saved ones in
the new dtype; and one more update must run. What cannot change (the optimizer kind, a padded
vocabulary the new TP does not divide) is refused by `sparserl train` before any rank starts.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import torch
from e2e_support import PY, make_assets, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.trainer.run_layout import RunLayout, resume_problem

WORKER = str(pathlib.Path(__file__).with_name("resume_worker.py"))
LAYOUTS = {"pp2_bf16": torch.bfloat16, "dp2_fp32": torch.float32}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("resume")
    hf = make_assets(root)
    cfg = write_config(root, hf, "resume", train={"micro_batch_size": 4})
    launch_local([WORKER, str(cfg), str(root)], 2, env=subprocess_env(), timeout=420)
    return root, cfg


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_optimizer_state_and_weights_reshard_exactly(resumed, name):
    root, _ = resumed
    saved, loaded = torch.load(root / "saved.pt"), torch.load(root / f"{name}.pt")
    assert saved["exp_avg"]["lm_head.weight"].abs().sum() > 0  # the updates happened
    assert saved["adam_steps"] == loaded["adam_steps"] == [4.0]  # 2 batches x 2 DGG epochs
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert saved[kind].keys() == loaded[kind].keys()
        bad = [n for n in saved[kind] if not _bits_equal(saved[kind][n], loaded[kind][n])]
        assert bad == [], f"{name}: {kind} differs in {bad[:4]}"
    dtype = LAYOUTS[name]
    for n, weight in saved["model"].items():
        assert _bits_equal(loaded["model"][n], weight.to(dtype)), f"{name}: {n}"
        assert _bits_equal(loaded["model"][n], loaded["master"][n].to(dtype)), f"{name}: {n} vs its master"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_training_continues_after_a_layout_change(resumed, name):
    found = json.loads((resumed[0] / f"{name}.json").read_text())
    assert found["loop"] == {"step": 2} and found["rng_restored"] is False
    assert found["train/updates"] > 0 and found["dgg/gated"] == 0, found
    assert all(v == v for v in found.values() if isinstance(v, float)), found  # no NaN


def test_an_optimizer_change_is_refused_before_any_rank_starts(resumed):
    root, cfg = resumed
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2"]
    overrides = [f"checkpoint.dir={root / 'ckpt'}", "optimizer.distributed=false"]
    proc = subprocess.run(
        [*cmd, *overrides], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch.distributed.run" not in proc.stdout + proc.stderr, proc.stderr
    assert "saved at TP=2 PP=1 CP=1 DP=1 fp32 distributed optimizer" in lines[0], lines[0]
    assert "requested TP=2 PP=1 CP=1 DP=1 fp32 replicated optimizer" in lines[0], lines[0]
    assert "optimizer.distributed=true" in lines[0]


def _layout(**kw) -> RunLayout:
    base = {
        "world_size": 2,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "params_dtype": "fp32",
        "distributed_optimizer": True,
    }
    return RunLayout(**{**base, **kw})


def test_resume_rules():
    saved = _layout(padded_vocab_size=152064)  # Qwen2.5's vocabulary padded at TP=2 (multiple 256)
    assert (
        resume_problem(saved, _layout(world_size=8, tensor_model_parallel_size=4), same_world_files=False)
        is None
    )
    assert (
        resume_problem(
            saved, _layout(tensor_model_parallel_size=1, params_dtype="bf16"), same_world_files=False
        )
        is None
    )
    refused = resume_problem(
        saved, _layout(world_size=5, tensor_model_parallel_size=5), same_world_files=False
    )
    assert refused and "padded vocabulary 152064 is not divisible by TP=5" in refused
    assert resume_problem(None, _layout(), same_world_files=True) is None  # an older checkpoint, same ranks
    unknown = resume_problem(None, _layout(world_size=4), same_world_files=False)
    assert unknown and "records no layout" in unknown
