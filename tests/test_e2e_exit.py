"""A finished run leaves: `sparserl train` (TP=2, 2 gloo ranks under torchrun, a checkpoint every
step, so megatron's checkpoint writer processes exist) exits within 10 s of its last step's log
line, and every process it started is gone (engines closed, process groups destroyed, megatron's
checkpoint helpers joined). On an H100 the same run had not exited 200 s after its last step.
"""

from __future__ import annotations

import subprocess
import time

import psutil
from e2e_support import REPO, make_assets, subprocess_env, write_config

from sparserl_mcore.parallel.launch import torchrun_command

TRAIN = str(REPO / "launchers" / "train.py")
EXIT_WITHIN_S = 10.0


def test_run_exits_within_10_s_of_its_last_step_and_leaves_no_process(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "exit",
        train={"steps": 2},
        eval={"every": 2},  # evaluated inside step 2: nothing but the final save after its line
        checkpoint={"every": 1, "save_hf": None},
    )
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(cfg)], 2),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: dict[int, psutil.Process] = {}
    last_step_at, lines = None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
            if line.startswith("step 2 "):
                last_step_at = time.monotonic()
        proc.wait(timeout=120)
        exited_at = time.monotonic()
    finally:
        if proc.poll() is None:
            for child in seen.values():
                child.kill()
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == 0, output[-3000:]
    assert last_step_at is not None, output[-3000:]
    assert len(seen) >= 3, seen  # two ranks and megatron's checkpoint manager at least
    took = exited_at - last_step_at
    assert took < EXIT_WITHIN_S, f"exit took {took:.1f} s after the last step\n{output[-3000:]}"
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
