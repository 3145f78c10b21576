"""`parallel.launch.run_ranks` with real torchrun subprocesses: per-rank logs, one line per distinct
error, a killed rank bringing the run down, and no orphans when the launcher is stopped or killed;
then the same for the real `sparserl train --nproc` and `sparserl convert`.

The ranks are tiny scripts run through `rank_entry.rank_main`, as launchers/*.py are. They tell the
test they are up by connecting to a socket it listens on (rank, pid), so the test waits on that
event, never on a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from e2e_support import make_assets, subprocess_env, write_config
from waiting import wait_until

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import run_ranks

RANK_SCRIPT = """
import os, signal, socket, sys, threading
from sparserl_mcore.parallel.rank_entry import rank_main

def main():
    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    if mode == "term":  # rank 0 saves and exits on SIGTERM; rank 1 ignores it
        marker = sys.argv[3]
        def saved(*_):
            open(marker, "w").write("saved")
            os._exit(0)
        signal.signal(signal.SIGTERM, saved if rank == 0 else signal.SIG_IGN)
    stop, asked = threading.Event(), []
    if mode == "slow-stop":  # counts its stop requests, from before it says it is up
        signal.signal(signal.SIGTERM, lambda *_: (asked.append(1), stop.set()))
    with socket.create_connection(("127.0.0.1", int(sys.argv[2]))) as s:
        s.sendall(f"{rank} {os.getpid()}\\n".encode())
        if mode in ("error", "code"):  # all ranks fail together, once the test says go
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's stop must not win the race
            s.recv(1)
            if mode == "code":
                print("sparserl train: no rollout engine left", file=sys.stderr)
                return 3
            raise ValueError("rank one is different" if rank == 1 else "bad layout: TP=3 on 4 heads")
    if mode == "suicide" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "slow-stop":  # a stop that takes a while, as a stop checkpoint does
        stop.wait()
        open(os.path.join(sys.argv[3], f"stopping{rank}"), "w").close()
        threading.Event().wait(3.0)
        print(f"asked to stop {len(asked)} time(s)", file=sys.stderr)
        return 0
    threading.Event().wait()

sys.exit(rank_main(main))
"""

LAUNCHER_SCRIPT = """
import sys
from sparserl_mcore.parallel.launch import run_ranks
result = run_ranks(sys.argv[3:], int(sys.argv[1]), log_dir=sys.argv[2], grace_s=3.0)
print("\\n".join(result.failure_lines()), file=sys.stderr)
sys.exit(result.returncode)
"""


@pytest.fixture()
def rank_script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


class _Roll:
    """Collects (rank -> pid) as ranks connect; `wait(n)` blocks until n ranks have, `go()` releases
    ranks that wait for the word."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.pids: dict[int, int] = {}
        self.conns: list[socket.socket] = []

    def wait(self, n: int, timeout: float = 120) -> dict[int, int]:
        self.sock.settimeout(timeout)
        while len(self.pids) < n:
            conn, _ = self.sock.accept()
            rank, pid = conn.makefile().readline().split()
            self.pids[int(rank)] = int(pid)
            self.conns.append(conn)
        return self.pids

    def go(self) -> None:
        for conn in self.conns:
            conn.sendall(b"g")

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        outcome["result"] = fn()
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def _gone(pids, timeout: float = 60) -> list[int]:
    """The pids still alive after waiting up to `timeout` for them to exit."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_failures_are_one_line_per_distinct_error_with_their_log(tmp_path, rank_script, capfd):
    logs, roll = tmp_path / "logs", _Roll()
    thread, outcome = _in_thread(lambda: run_ranks([rank_script, "error", str(roll.port)], 3, log_dir=logs))
    try:
        roll.wait(3)
        roll.go()
        thread.join(120)
    finally:
        roll.close()
    result = outcome["result"]
    assert result.returncode == 1
    lines = result.failure_lines()
    assert lines == [
        f"ranks 0, 2: ValueError: bad layout: TP=3 on 4 heads (log: {logs / 'rank0.log'})",
        f"rank 1: ValueError: rank one is different (log: {logs / 'rank1.log'})",
    ]
    assert "Traceback" in (logs / "rank2.log").read_text()
    console = capfd.readouterr()
    assert "Traceback" not in console.out + console.err and "ChildFailedError" not in console.err


def test_a_rank_exit_code_is_kept_with_its_last_words(tmp_path, rank_script):
    roll = _Roll()
    argv = [rank_script, "code", str(roll.port)]
    thread, outcome = _in_thread(lambda: run_ranks(argv, 2, log_dir=tmp_path / "logs", timeout=120))
    try:
        roll.wait(2)
        roll.go()
        thread.join(120)
    finally:
        roll.close()
    result = outcome["result"]
    assert result.returncode == 3
    assert result.failure_lines()[0].startswith(
        "ranks 0-1: exited with code 3: sparserl train: no rollout engine left"
    )


def test_a_killed_rank_brings_the_run_down_within_seconds(tmp_path, rank_script):
    roll = _Roll()
    argv = [rank_script, "suicide", str(roll.port)]
    thread, outcome = _in_thread(lambda: run_ranks(argv, 2, log_dir=tmp_path / "logs", timeout=120))
    try:
        pids = roll.wait(2)  # rank 1 kills itself right after reporting
        killed = time.monotonic()
        thread.join(120)
    finally:
        roll.close()
    assert not thread.is_alive()
    result = outcome["result"]
    assert outcome["ended"] - killed < 10, (
        "torchrun should notice a dead rank within its 0.1 s monitor interval"
    )
    assert result.returncode == 1
    assert result.failure_lines()[0] == f"rank 1: killed by SIGKILL (log: {tmp_path / 'logs' / 'rank1.log'})"
    assert _gone(pids.values(), timeout=10) == []


def _start_launcher(tmp_path, rank_script, mode: str, port: int) -> subprocess.Popen:
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER_SCRIPT)
    argv = [sys.executable, str(launcher), "2", str(tmp_path / "logs"), rank_script, mode, str(port)]
    argv += [str(tmp_path / "saved")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_is_forwarded_to_the_ranks_then_escalated(tmp_path, rank_script):
    roll = _Roll()
    launcher = _start_launcher(tmp_path, rank_script, "term", roll.port)
    try:
        pids = roll.wait(2)
        torchrun = psutil.Process(launcher.pid).children()[0].pid
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        roll.close()
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert (tmp_path / "saved").read_text() == "saved"  # rank 0 got SIGTERM and could save
    assert "stopped by SIGTERM" in err
    assert _gone([torchrun, *pids.values()], timeout=10) == []  # rank 1 ignored SIGTERM: killed after 3 s


@pytest.mark.parametrize("victim", ["launcher", "torchrun"])
def test_sigkill_leaves_no_orphans(tmp_path, rank_script, victim):
    """SIGKILL of the launcher: torchrun gets SIGTERM from the kernel and stops its ranks.
    SIGKILL of torchrun itself: every rank gets SIGKILL from the kernel."""
    roll = _Roll()
    launcher = _start_launcher(tmp_path, rank_script, "idle", roll.port)
    try:
        pids = roll.wait(2)
        torchrun = psutil.Process(launcher.pid).children()[0].pid
        os.kill(launcher.pid if victim == "launcher" else torchrun, signal.SIGKILL)
        assert _gone([torchrun, *pids.values()]) == []
    finally:
        roll.close()
        launcher.kill()
        launcher.communicate()


# The launcher's stand-in for the next test: torchrun is started by a thread that exits once the
# ranks are up (Linux then sends torchrun its parent-death signal), and the process is SIGKILLed
# once the ranks are stopping (the signal again): what a killed launcher with threads does.
TWO_PARENT_DEATHS = """
import os, signal, subprocess, sys, threading
from sparserl_mcore.parallel.launch import _torchrun_dies_with_us, torchrun_command
from sparserl_mcore.parallel.rank_entry import LOG_DIR_ENV

log_dir, argv = sys.argv[1], sys.argv[2:]
up = threading.Event()
def start():
    subprocess.Popen(torchrun_command(argv, 2, log_dir=os.path.join(log_dir, "torchelastic")),
                     env={**os.environ, LOG_DIR_ENV: log_dir}, preexec_fn=_torchrun_dies_with_us,
                     stderr=open(os.path.join(log_dir, "torchrun.log"), "w"))
    up.wait()
thread = threading.Thread(target=start)
thread.start()
sys.stdin.readline()  # the ranks are up
up.set()
thread.join()
sys.stdin.readline()  # the ranks are stopping
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_repeated_parent_death_signal_still_lets_the_ranks_finish_their_stop(tmp_path, rank_script):
    """torchrun takes its parent-death signal as one stop request however often the kernel sends it
    (here twice: its parent thread, then its parent process). It used to take each as a SIGTERM,
    send the ranks a second stop request, and a third would end it mid-stop with its ranks."""
    logs, roll = tmp_path / "logs", _Roll()
    logs.mkdir()
    launcher_script = tmp_path / "two_deaths.py"
    launcher_script.write_text(TWO_PARENT_DEATHS)
    argv = [
        sys.executable,
        str(launcher_script),
        str(logs),
        rank_script,
        "slow-stop",
        str(roll.port),
        str(logs),
    ]
    launcher = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True)
    try:
        pids = roll.wait(2)
        launcher.stdin.write("up\n")
        launcher.stdin.flush()
        stopping = [logs / f"stopping{rank}" for rank in (0, 1)]
        wait_until(lambda: all(p.exists() for p in stopping), timeout=60, what="both ranks stopping")
        launcher.stdin.write("stopping\n")
        launcher.stdin.flush()
        assert launcher.wait(timeout=60) == -signal.SIGKILL
        assert _gone(pids.values(), timeout=60) == []
    finally:
        roll.close()
        launcher.kill()
        launcher.wait()
    records = [json.loads(p.read_text()) for p in sorted(logs.glob("rank*.exit.json"))]
    assert [r["exit_code"] for r in records] == [0, 0], (logs / "torchrun.log").read_text()[-3000:]
    asked = [(logs / f"rank{rank}.log").read_text().strip() for rank in (0, 1)]
    assert asked == ["asked to stop 1 time(s)"] * 2, (logs / "torchrun.log").read_text()[-3000:]


# -- the real commands ---------------------------------------------------------------------------


def _ranks_of(launcher: subprocess.Popen, entry: str, n: int) -> list[psutil.Process]:
    """The launcher's rank processes (cmdline names `entry`), once all `n` have started. torchrun's
    own cmdline names `entry` too (`-m sparserl_mcore.parallel.torchrun ... -m entry`): not a rank."""

    def ranks() -> list[psutil.Process] | None:
        assert launcher.poll() is None, launcher.communicate()
        found = []
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                cmdline = " ".join(proc.cmdline())
                if entry in cmdline and "parallel.torchrun" not in cmdline:
                    found.append(proc)
        return found if len(found) == n else None

    return wait_until(ranks, timeout=120, what=f"{n} ranks running {entry}")


def test_ctrl_c_of_sparserl_train_stops_every_rank_and_says_sigint(tmp_path):
    """Mid-run, the ranks checkpoint and the run reports one outcome: stopped by SIGINT (not "done",
    not "failed", not the SIGTERM of other stops), exit code 128 + SIGINT."""
    hf = make_assets(tmp_path)
    cfg = write_config(tmp_path, hf, "term", train={"steps": 20})
    cmd = [sys.executable, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2"]
    launcher = subprocess.Popen(
        cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _ranks_of(launcher, "sparserl_mcore.launch.train", 2)
        everyone = psutil.Process(launcher.pid).children(recursive=True)
        wait_until(lambda: _logged_step(tmp_path / "term", launcher), timeout=300, what="step 1")
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert re.search(
        r"^sparserl train: stopped by SIGINT: steps 0 -> \d+ in .*; rerun the same", out, re.M
    ), out
    assert "done" not in out and err == "", (out, err)  # one outcome, said once
    assert _gone([p.pid for p in everyone], timeout=10) == []


def _logged_step(run, launcher: subprocess.Popen) -> bool:
    assert launcher.poll() is None, launcher.communicate()
    path = run / "metrics" / "metrics.jsonl"
    return path.is_file() and '"rollout/reward_mean"' in path.read_text()


def test_sigkill_of_sparserl_convert_then_the_next_writer_clears_its_temp(tmp_path):
    hf = make_tiny(TinyModelConfig(arch="qwen2"), tmp_path / "hf")
    out = tmp_path / "mcore"
    cmd = [sys.executable, "-m", "sparserl_mcore", "convert", "hf-to-mcore", "--hf-dir", str(hf)]
    cmd += ["--out", str(out), "--tp", "2"]
    (tmp_path / "tmp").mkdir()  # the killed command cannot remove its log dir: keep it in tmp_path
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _ranks_of(launcher, "sparserl_mcore.launch.convert", 2)
        everyone = psutil.Process(launcher.pid).children(recursive=True)
        launcher.kill()
        assert _gone([p.pid for p in everyone]) == []
    finally:
        launcher.kill()
        launcher.communicate()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], "the killed writer's temp dir"
    make_tiny(TinyModelConfig(arch="qwen2"), out)  # the next writer of the same output
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_killed_tree_leaves_its_root_exit_status_to_popen():
    """The launcher's kill (its grace timer's thread) must not reap torchrun: the main thread's
    `Popen.wait` would then read exit code 0, and a stopped launch would pass as a clean one."""
    from sparserl_mcore.parallel.launch import _kill_tree

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                              "time.sleep(60)"])  # fmt: skip
    try:
        wait_until(lambda: psutil.Process(child.pid).children(), timeout=30, what="the grandchild")
        grandchild = psutil.Process(child.pid).children()[0]
        _kill_tree(child.pid)
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
