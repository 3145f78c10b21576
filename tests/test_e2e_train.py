"""End to end on CPU: `sparserl train` with TP=2 over 2 gloo processes on a random tiny Qwen2.

One uninterrupted run (reward must rise on an easy task) and one `sparserl train --nproc 2` run
whose rank 1 is SIGKILLed right after its step-2 checkpoint: the run comes down within seconds,
naming the rank, and the rerun resumes and ends with bit-identical HF weights; a third start finds
the run complete and writes nothing.
"""

from __future__ import annotations

import re
import subprocess
import time

import psutil
import pytest
import torch
from e2e_support import PY, REPO, make_assets, metrics, subprocess_env, write_config
from safetensors.torch import load_file
from waiting import wait_until

from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.telemetry import read_metrics

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


@pytest.mark.timeout(600)
def test_tp2_reward_rises_and_sigkill_resume_is_bit_identical(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    full = write_config(tmp_path, hf, "full")
    launch_local([TRAIN, "--config", str(full)], 2, env=env, timeout=300)
    rewards = [r["rollout/reward_mean"] for r in metrics(tmp_path, "full") if "rollout/reward_mean" in r]
    assert len(rewards) == 4
    assert sum(rewards[2:]) > sum(rewards[:2]), rewards
    assert (tmp_path / "full" / "hf" / "model.safetensors.index.json").is_file()

    # The same run under `sparserl train --nproc 2`; rank 1 is SIGKILLed mid step 4, after the
    # step-2 checkpoint and step 3's metrics: the launcher ends the run within seconds, naming the
    # rank, and step 3 is abandoned (logged, not checkpointed).
    killed = write_config(tmp_path, hf, "killed")
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(killed), "--nproc", "2"]
    latest = tmp_path / "killed" / "ckpt" / "latest"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _logged(tmp_path, 3, proc), timeout=240, what="step 3 in metrics.jsonl")
        rank1 = next(p for p in psutil.Process(proc.pid).children(recursive=True) if _rank(p) == "1")
        everyone = psutil.Process(proc.pid).children(recursive=True)
        rank1.kill()
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        down_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and down_s < 15, (down_s, err)
    assert latest.read_text().strip() == "step_00000002"
    assert re.search(r"^  rank 1: killed by SIGKILL \(log: .*rank1\.log\)$", err, re.M), err
    assert "Traceback" not in err
    assert psutil.wait_procs(everyone, timeout=10)[1] == []
    assert not (tmp_path / "killed" / "hf").exists()

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.startswith(
        f"sparserl train: resuming from {latest.parent / 'step_00000002'} at step 2 of 4"
    )
    assert (
        "done: steps 2 -> 4" in rerun.stdout and f"HF export:  {tmp_path / 'killed' / 'hf'}" in rerun.stdout
    )
    events = [r for r in metrics(tmp_path, "killed") if r.get("event") == "resumed"]
    assert [(e["step"], e["rng"]) for e in events] == [(2, "restored")]
    # the re-run step 3 replaced the abandoned one: every step once, as in the uninterrupted run;
    # updates.jsonl (the per-update DWD / DGG history) too, not cut at the resume (issue 36)
    assert _step_rewards(tmp_path, "killed") == _step_rewards(tmp_path, "full")
    assert _update_rows(tmp_path, "killed") == _update_rows(tmp_path, "full")
    assert {s for s, _ in _update_rows(tmp_path, "full")} == {1, 2, 3, 4}

    a, b = _weights(tmp_path / "full" / "hf"), _weights(tmp_path / "killed" / "hf")
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    # Run again: already at train.steps, it says so and writes nothing.
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "killed").rglob("*")}
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.startswith("sparserl train: already complete"), again
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "killed").rglob("*")} == written


def _rank(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("RANK")
    except psutil.Error:
        return None


def _step_rewards(root, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r["rollout/reward_mean"]) for r in metrics(root, name) if "rollout/reward_mean" in r]


def _update_rows(root, name: str) -> list[tuple[int, int]]:
    return [(r["step"], r["update"]) for r in read_metrics(root / name / "metrics" / "updates.jsonl")]


def _logged(root, step: int, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.communicate()
    try:
        return any(s == step for s, _ in _step_rewards(root, "killed"))
    except FileNotFoundError:
        return False


def test_nonfinite_loss_skips_every_update_and_leaves_weights_and_sync_untouched(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "nan",
        reward={"name": "e2e_support:overflow_reward"},
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
