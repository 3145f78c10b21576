"""A finished run leaves: `sparserl train`'s ranks (TP=2, 2 gloo ranks under torchrun, a checkpoint
every step, so megatron's checkpoint helper processes exist) are gone within 10 s of the last
step's log line, the launcher right after them, and no process the run started is left (engines
closed, process groups destroyed, megatron's checkpoint helpers joined). On an H100 the same
kind of run had not exited 200 s after its last step.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time

import psutil
from e2e_support import REPO, make_assets, subprocess_env, write_config

from sparserl_mcore.parallel.launch import torchrun_command

TRAIN = str(REPO / "launchers" / "train.py")
RANKS_EXIT_WITHIN_S = 10.0
LAUNCHER_AFTER_RANKS_S = 5.0  # torchrun's own teardown (1-4 s measured on the shared 2-core box)


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put((time.monotonic(), line))
    out.put((time.monotonic(), None))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _is_rank(p: psutil.Process) -> bool:
    try:
        return TRAIN in " ".join(p.cmdline())
    except psutil.Error:  # gone meanwhile
        return False


def test_run_exits_within_10_s_of_its_last_step_and_leaves_no_process(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "exit",
        train={"steps": 2},
        eval={"every": 2},  # evaluated inside step 2: only the final save follows its line
        checkpoint={"every": 1, "save_hf": None},
    )
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(cfg)], 2, log_dir=tmp_path / "torchrun"),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: dict[int, psutil.Process] = {}
    output, last_step_at, ranks_gone_at, deadline = [], None, None, time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            ranks = [p for p in _descendants(proc.pid) if _is_rank(p)]
            for p in _descendants(proc.pid):
                seen.setdefault(p.pid, p)
            if last_step_at is not None and ranks_gone_at is None and not ranks:
                ranks_gone_at = time.monotonic()
            while not lines.empty():
                at, line = lines.get()
                output.append(line or "")
                if line and line.startswith("step 2 "):
                    last_step_at = at
            time.sleep(0.05)
        exited_at = time.monotonic()
    finally:
        if proc.poll() is None:
            for p in [*seen.values(), psutil.Process(proc.pid)]:
                p.kill()
    text = "".join(output)
    assert proc.wait(timeout=30) == 0, text[-3000:]
    assert last_step_at is not None and ranks_gone_at is not None, text[-3000:]
    assert len(seen) >= 3, seen  # two ranks and megatron's checkpoint manager at least
    ranks_s, launcher_s = ranks_gone_at - last_step_at, exited_at - ranks_gone_at
    assert ranks_s < RANKS_EXIT_WITHIN_S, f"ranks exited {ranks_s:.1f} s after the last step\n{text[-3000:]}"
    assert launcher_s < LAUNCHER_AFTER_RANKS_S, f"torchrun exited {launcher_s:.1f} s after its ranks"
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
