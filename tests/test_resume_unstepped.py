"""A checkpoint written before the optimizer ever stepped resumes, and training goes on from it.

That checkpoint is common in RL: early steps whose groups all score the same are filtered out
whole, and a stop signal can arrive before the first update. Megatron saves only the optimizer
state that exists (and drops a step of 0), so without care the rerun dies loading it. Both
optimizer kinds, through `sparserl train` on 2 gloo ranks: step 1 scores every sample 0 (no
update) and checkpoints; the rerun to step 2 scores for real and must update.
"""

from __future__ import annotations

import subprocess

import pytest
from e2e_support import PY, make_assets, metrics, subprocess_env, write_config


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("unstepped")
    return root, make_assets(root)


def _train(cfg, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_a_checkpoint_before_the_first_update_resumes(assets, distributed):
    root, hf = assets
    name = f"opt_{distributed}"
    cfg = write_config(
        root,
        hf,
        name,
        optimizer={"distributed": distributed},
        train={"steps": 2},
        checkpoint={"dir": str(root / name / "ckpt"), "every": 1},
        telemetry={"dir": str(root / name / "metrics"), "plot": False, "progress": False},
    )
    first = _train(cfg, "train.steps=1", "reward.name=e2e_support:zero_reward")
    assert first.returncode == 0, first.stderr
    assert [r["train/sequences"] for r in metrics(root, name) if "train/sequences" in r] == [0]

    rerun = _train(cfg)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming from" in rerun.stdout and "at step 1 of 2" in rerun.stdout
    (step2,) = [r for r in metrics(root, name) if "train/sequences" in r and r["step"] == 2]
    assert step2["train/updates"] > 0, step2
