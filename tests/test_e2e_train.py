"""End to end on CPU: `sparserl train` with TP=2 over 2 gloo processes on a random tiny Qwen2.

One uninterrupted run (reward must rise on an easy task) and one run killed with SIGKILL right
after its step-2 checkpoint, then resumed: both end with bit-identical HF weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch
from e2e_support import PY, REPO, make_assets, metrics, subprocess_env, write_config
from safetensors.torch import load_file

from sparserl_mcore.parallel.launch import launch_local, torchrun_command

TRAIN = str(REPO / "launchers" / "train.py")


def _weights(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_train_rejects_a_bad_override_naming_the_key(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(tmp_path, hf, "bad")
    proc = subprocess.run(
        [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "rollout.kv.metod=snapkv"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown key rollout.kv.metod" in proc.stderr and "method" in proc.stderr


@pytest.mark.timeout(420)
def test_tp2_reward_rises_and_sigkill_resume_is_bit_identical(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    full = write_config(tmp_path, hf, "full")
    launch_local([TRAIN, "--config", str(full)], 2, env=env, timeout=300)
    rewards = [r["rollout/reward_mean"] for r in metrics(tmp_path, "full") if "rollout/reward_mean" in r]
    assert len(rewards) == 4
    assert sum(rewards[2:]) > sum(rewards[:2]), rewards
    assert (tmp_path / "full" / "hf" / "model.safetensors.index.json").is_file()

    killed = write_config(tmp_path, hf, "killed")
    latest = tmp_path / "killed" / "ckpt" / "latest"
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(killed)], 2),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not (latest.is_file() and "step_00000002" in latest.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, (
                "run ended before its step-2 checkpoint"
            )
            time.sleep(0.2)
        # mid step 3: torchrun starts each rank in its own session, so kill the ranks by pid too
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.send_signal(signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not (tmp_path / "killed" / "hf").exists()
    launch_local([TRAIN, "--config", str(killed)], 2, env=env, timeout=300)
    events = [r for r in metrics(tmp_path, "killed") if r.get("event") == "resumed"]
    assert events and events[0]["step"] == 2

    a, b = _weights(tmp_path / "full" / "hf"), _weights(tmp_path / "killed" / "hf")
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_loss_skips_every_update_and_leaves_weights_and_sync_untouched(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "nan",
        reward={"name": "e2e_support:nan_reward"},
        train={"steps": 2, "filter_zero_variance_groups": False},
        checkpoint={"every": 0},
    )
    launch_local([TRAIN, "--config", str(cfg)], 2, env=subprocess_env(), timeout=300)
    records = metrics(tmp_path, "nan")
    steps = [r for r in records if "train/skipped_nonfinite" in r]
    assert [r["train/skipped_nonfinite"] > 0 and r["train/updates"] == 0 for r in steps] == [True, True]
    assert not any("sync/patch_bytes" in r for r in records)  # the engines' version never moved
    assert sum(r.get("event") == "nonfinite_update_skipped" for r in records) == 2
    before, after = _weights(hf), _weights(tmp_path / "nan" / "hf")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
