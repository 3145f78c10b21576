"""Run a Python entry point on N local ranks with torchrun, as a real subprocess, and own its lifetime.

Two ways in, neither imports torch (callers stay cheap):
- `run_ranks` (the user-facing commands: `sparserl train --nproc`, `convert`, `convert verify`):
  each rank's output goes to its own log file under `log_dir` (`rank_entry.rank_main`), torchrun's
  own output to `log_dir/torchrun.log`; the console keeps rank 0's stdout (the progress display).
  The result can summarise a failure in one line per distinct error (`rank_entry.summarize`).
- `launch_local` (tests, benchmarks): output captured into a `LaunchError` on failure.

Lifetime (the contract a rank's checkpoint-on-SIGTERM handler can rely on):
- SIGTERM or SIGINT (Ctrl-C) to the launching process: the same signal is forwarded to every rank,
  so a rank can save a checkpoint, exit and say which signal stopped it. Ranks still alive
  `grace_s` seconds later (SPARSERL_STOP_GRACE_S, default 60) are SIGKILLed with torchrun; a second
  signal kills at once.
  The launcher then exits 128 + the signal number.
- SIGKILL of the launching process: the kernel signals torchrun (PR_SET_PDEATHSIG, set in the
  child before exec), which takes it as one SIGTERM however often it comes (`parallel.torchrun`);
  torchrun SIGTERMs its ranks' process groups and SIGKILLs them 30 s later.
  The trainer's ranks take it as a stop: they finish the step, checkpoint and exit 0 (their console
  output goes on in rank 0's log, `rank_entry.ConsoleOut`).
- A rank whose torchrun dies gets SIGKILL (`rank_entry` sets its own parent-death signal).
- A rank that dies: torchrun sees it within its 0.1 s monitor interval and stops the others.
torchrun's own files go to `log_dir/torchelastic/` (removed when it exits, and by the next launch into
the same log dir if the launcher was killed), never to a `torchelastic_*` folder in the temp dir.
torchrun starts every rank in a session of its own, so teardown walks the process tree rather than
signalling one process group; once torchrun is gone, every rank's process group is killed too
(the children of a rank that died, e.g. dist-checkpoint workers, would outlive the run otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil

from sparserl_mcore.parallel.rank_entry import (
    LOG_DIR_ENV,
    TORCHRUN_DIR,
    clear_logs,
    common_exit_code,
    die_with_parent,
    rank_groups,
    summarize,
)
from sparserl_mcore.parallel.torchrun import PARENT_GONE

GRACE_ENV = "SPARSERL_STOP_GRACE_S"
DEFAULT_GRACE_S = 60.0


class LaunchError(RuntimeError):
    """A torchrun launch failed; the message carries the command, exit code and captured output."""

    def __init__(self, cmd: Sequence[str], returncode: int | None, output: str) -> None:
        status = "timed out" if returncode is None else f"exited with code {returncode}"
        super().__init__(f"{' '.join(cmd)} {status}\n--- output ---\n{output}")
        self.returncode = returncode
        self.output = output


def torchrun_command(
    argv: Sequence[str], nproc: int, *, log_dir: str | os.PathLike | None = None
) -> list[str]:
    """torchrun (`python -m sparserl_mcore.parallel.torchrun`: `torch.distributed.run` behind a
    parent-death guard) `--standalone --nproc_per_node N <argv>` for this interpreter.

    log_dir: torchrun's own per-run files (its workers' error records). Without it torchrun makes a
    `torchelastic_*` directory in the temp directory for every launch and never removes it; the
    launchers here give it a folder of the launch's own, removed with the launch.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: must be >= 1")
    head = [sys.executable, "-m", "sparserl_mcore.parallel.torchrun", "--standalone"]
    head.append(f"--nproc_per_node={nproc}")
    return head + ([f"--log-dir={log_dir}"] if log_dir is not None else []) + list(argv)


def _torchrun_dies_with_us() -> None:
    """preexec_fn of torchrun: PARENT_GONE when this process exits (see `parallel.torchrun`)."""
    die_with_parent(PARENT_GONE)


def _kill_tree(pid: int) -> None:
    """SIGKILL a child process and all its descendants, and wait for the descendants to go.

    The child itself is left for its `Popen` to reap: waiting on it here (psutil reaps a child it
    waits for) would race the `Popen.wait` of another thread, which then reads the lost status as
    exit code 0 and a killed launch as a clean one."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in [*descendants, root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(descendants, timeout=30)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}


def launch_local(
    argv: Sequence[str],
    nproc: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` (a script path or `-m module` plus its arguments) on `nproc` local ranks.

    OMP_NUM_THREADS defaults to 1 (ranks share the machine's cores). stdout and stderr are captured
    together; on a non-zero exit or a timeout a `LaunchError` with that output is raised. A timeout
    (or an interrupt) kills torchrun and every rank.
    """
    with tempfile.TemporaryDirectory(prefix="sparserl-torchrun-") as own:
        cmd = torchrun_command(argv, nproc, log_dir=own)
        with subprocess.Popen(
            cmd,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_torchrun_dies_with_us,
        ) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                output, _ = proc.communicate()
                raise LaunchError(cmd, None, output) from None
            except BaseException:
                _kill_tree(proc.pid)
                raise
    if proc.returncode != 0:
        raise LaunchError(cmd, proc.returncode, output)
    return subprocess.CompletedProcess(cmd, proc.returncode, output, None)


@dataclasses.dataclass(frozen=True)
class RanksResult:
    """How a `run_ranks` launch ended. `returncode`: 0 when every rank succeeded; a rank's own exit
    code when every failed rank exited with that same code (e.g. the trainer's 3); 128 + signal when
    the launcher was stopped by one; 1 otherwise (including a timeout)."""

    returncode: int
    log_dir: Path
    nproc: int
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT" when a signal stopped the run
    timed_out: bool = False
    stopped_cleanly: bool = False  # stopped by a signal, and every rank then exited 0 by itself

    def failure_lines(self) -> list[str]:
        """One line per distinct error, naming the ranks and the log file with the full traceback;
        none for a run whose ranks ended cleanly (also after a stop signal: they report it)."""
        if self.returncode == 0 or self.stopped_cleanly:
            return []
        if self.stopped_by:  # what the ranks report after a stop is its consequence
            return [f"stopped by {self.stopped_by}; rank logs: {self.log_dir}"]
        head = [f"timed out: every rank was killed; rank logs: {self.log_dir}"] if self.timed_out else []
        return head + summarize(self.log_dir, self.nproc)


class RanksFailed(RuntimeError):
    """Raised by callers that treat a failed `run_ranks` as an error; the message is its summary."""

    def __init__(self, result: RanksResult) -> None:
        super().__init__("\n".join(result.failure_lines()))
        self.result = result


class _Stopper:
    """Signal handling of one launch (see the module docstring): forward SIGTERM, escalate later."""

    def __init__(self, proc: subprocess.Popen, grace_s: float) -> None:
        self.proc, self.grace_s = proc, grace_s
        self.signum: int | None = None
        self._timer: threading.Timer | None = None

    def _targets(self) -> list[psutil.Process]:
        """torchrun's children (the ranks), or torchrun itself while it has none yet."""
        try:
            torchrun = psutil.Process(self.proc.pid)
            return torchrun.children() or [torchrun]
        except psutil.NoSuchProcess:
            return []

    def handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:  # a second signal: no more grace
            self.kill()
            return
        self.signum = signum
        for proc in self._targets():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)
        self._timer = threading.Timer(self.grace_s, self.kill)
        self._timer.daemon = True
        self._timer.start()

    def kill(self) -> None:
        _kill_tree(self.proc.pid)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handlers for SIGTERM/SIGINT while the ranks run (main thread only; elsewhere none)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            if self._timer is not None:
                self._timer.cancel()


def run_ranks(
    argv: Sequence[str],
    nproc: int,
    *,
    log_dir: str | os.PathLike,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    grace_s: float | None = None,
) -> RanksResult:
    """Run `argv` on `nproc` local ranks under torchrun; rank R's output goes to log_dir/rankR.log.

    The rank entry must run through `rank_entry.rank_main` (launchers/*.py do) for the per-rank
    logs and error records. Returns when every rank is gone (see the module docstring for signals).
    """
    log_path = clear_logs(log_dir)
    grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S)) if grace_s is None else grace_s
    cmd = torchrun_command(argv, nproc, log_dir=log_path / TORCHRUN_DIR)
    with (log_path / "torchrun.log").open("w") as torchrun_log:
        proc = subprocess.Popen(
            cmd,
            env={**_child_env(env), LOG_DIR_ENV: str(log_path)},
            stderr=torchrun_log,
            start_new_session=True,  # terminal signals reach the launcher only; it forwards them
            preexec_fn=_torchrun_dies_with_us,
        )
    stopper = _Stopper(proc, grace)
    timed_out = False
    with stopper.installed():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stopper.kill()
        except BaseException:
            stopper.kill()
            raise
        finally:
            proc.wait()
            _kill_groups(log_path)
            shutil.rmtree(log_path / TORCHRUN_DIR, ignore_errors=True)
    return _result(proc.returncode, log_path, nproc, stopper.signum, timed_out)


def _kill_groups(log_dir: Path) -> None:
    """SIGKILL what is left in the ranks' process groups (see the module docstring)."""
    for group in rank_groups(log_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def _result(code: int, log_dir: Path, nproc: int, signum: int | None, timed_out: bool) -> RanksResult:
    if signum is not None:
        name = signal.Signals(signum).name
        return RanksResult(128 + signum, log_dir, nproc, stopped_by=name, stopped_cleanly=code == 0)
    if timed_out:
        return RanksResult(1, log_dir, nproc, timed_out=True)
    if code == 0:
        return RanksResult(0, log_dir, nproc)
    return RanksResult(common_exit_code(log_dir, nproc) or 1, log_dir, nproc)
