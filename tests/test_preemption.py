"""Preemption: SIGUSR1/SIGTERM stop a run at a step boundary with a checkpoint, exit 0, and the rerun
continues exactly where an uninterrupted run would be.

The end-to-end test signals only rank 1 of a TP=2 run (as a signal that reached part of a job
would): rank 0 must stop at the same step through the ranks' agreement, or the run would hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config
from safetensors.torch import load_file

from sparserl_mcore.parallel.launch import launch_local, torchrun_command
from sparserl_mcore.trainer.preemption import StopRequest

TRAIN = str(REPO / "launchers" / "train.py")


def test_stop_request_flags_the_first_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest() as stop:
        assert stop.signum == 0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signum == signal.SIGTERM  # the first one is kept
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_after_the_trainers_loop_a_late_sigterm_cannot_cut_its_teardown_short():
    """The trainer's use (`ignore_after`): once the loop is over, SIGTERM and SIGUSR1 are ignored
    (a second stop request from torchrun used to kill a rank before its exit record); Ctrl-C still
    interrupts. In a process of its own: without the fix that SIGTERM ends it."""
    code = (
        "import os, signal\n"
        "from sparserl_mcore.trainer.preemption import StopRequest\n"
        "with StopRequest(ignore_after=True) as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('alive', stop.signum, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"alive {int(signal.SIGTERM)} True"), proc.stderr


def _rank_process(torchrun: subprocess.Popen, rank: int, timeout: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(torchrun.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        time.sleep(0.2)
    raise TimeoutError(f"rank {rank} did not start")


def _wait_step(root, name: str, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended before step {step}"
        try:
            if any(r.get("step") == step and "rollout/reward_mean" in r for r in metrics(root, name)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not logged after {timeout} s")


def _step_records(root, name: str) -> dict[int, dict]:
    """Per step, the logged values that do not measure time."""
    out: dict[int, dict] = {}
    for r in metrics(root, name):
        if "rollout/reward_mean" in r:
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("time/") and k != "time"}
    return out


def _weights(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.timeout(480)
def test_sigusr1_to_one_rank_checkpoints_exits_0_and_the_rerun_matches_an_uninterrupted_run(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    sections = {"checkpoint": {"every": 0}, "train": {"steps": 4}}
    full = write_config(tmp_path, hf, "full", **sections)
    launch_local([TRAIN, "--config", str(full)], 2, env=env, timeout=300)

    cfg = write_config(tmp_path, hf, "stopped", **sections)
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(cfg)], 2, log_dir=tmp_path / "torchrun"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        rank1 = _rank_process(proc, 1)
        _wait_step(tmp_path, "stopped", 1, proc)
        rank1.send_signal(signal.SIGUSR1)  # mid step 2 (or at its boundary): rank 0 never sees it
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    events = [r for r in metrics(tmp_path, "stopped") if r.get("event") == "stopped"]
    assert len(events) == 1 and events[0]["reason"] == "SIGUSR1", events
    saved = events[0]["step"]
    assert 1 <= saved < 4
    latest = tmp_path / "stopped" / "ckpt" / "latest"
    assert latest.read_text().strip() == f"step_{saved:08d}"
    assert f"stopped by SIGUSR1: steps 0 -> {saved} in " in out and "done" not in out
    assert not (tmp_path / "stopped" / "hf").exists()  # no final export for a stopped run

    launch_local([TRAIN, "--config", str(cfg)], 2, env=env, timeout=300)
    resumed = [r for r in metrics(tmp_path, "stopped") if r.get("event") == "resumed"]
    assert [r["step"] for r in resumed] == [saved]
    want, got = _step_records(tmp_path, "full"), _step_records(tmp_path, "stopped")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert got == want  # every step's metrics, before and after the stop
    a, b = _weights(tmp_path / "full" / "hf"), _weights(tmp_path / "stopped" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
