"""What every rank entry (launchers/*.py) runs first, and how a launcher reads what its ranks left.

Rank side, `rank_main(main)`:
- a rank started by a launcher (RANK set) dies with its parent, so a torchrun killed outright
  leaves no orphan ranks behind (`die_with_parent`);
- under `launch.run_ranks` (SPARSERL_RANK_LOG_DIR set) the stderr of every rank and the stdout of
  ranks other than 0 go to `<log dir>/rank<R>.log`; rank 0's stdout stays on the console while
  there is one: when a write to it fails (the launcher was killed and its pipe closed, the terminal
  hung up) it moves to that log (`ConsoleOut`), so losing the console never stops a rank;
- megatron-core's import-time "Transformer Engine and Apex are not installed" / "Apex is not
  installed" warnings are dropped (the launcher says once what runs without them);
- it writes `<log dir>/rank<R>.pgid` (its process group: torchrun starts every rank in a session
  of its own, and what a rank spawns, e.g. dist-checkpoint worker processes, stays in that group)
  and `<log dir>/rank<R>.exit.json`: the exit code and, for an uncaught exception,
  "Type: first line of the message" (the full traceback goes to the rank's log);
- then a launched rank exits at once (`_leave`), without the interpreter's slow teardown.
Helper processes a rank spawns that must outlive a stop signal to its group start with
`helper_process_init`.

Launcher side, `summarize(log_dir, nproc)`: one line per distinct error with its ranks and the log
that holds the traceback; ranks killed by a signal are read from torchrun's own failure report.
`rank_groups(log_dir)`: the process groups to kill once torchrun is gone (torchrun stops only the
ranks still alive, so the children of a rank that died would otherwise outlive the run).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

LOG_DIR_ENV = "SPARSERL_RANK_LOG_DIR"
TORCHRUN_LOG = "torchrun.log"
TORCHRUN_DIR = "torchelastic"  # torchrun's --log-dir inside the log dir (launch.torchrun_command)
_PR_SET_PDEATHSIG = 1
_MAX_LINE = 300
# A collective failing because another rank died: the consequence, listed after the cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
# torchrun's ChildFailedError report: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)"
_SIGNALLED = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*-(\d+)")


def quiet_optional_backend_warnings() -> None:
    """Drop megatron-core's per-module warnings that transformer-engine / apex are missing."""
    warnings.filterwarnings("ignore", message="(Transformer Engine and Apex are|Apex is) not installed")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; a no-op elsewhere).

    Safe between fork and exec (a `preexec_fn`). A parent that exits while this is being set up is
    noticed (`sig` is raised at once); one that exited before this process got here is not.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


# The signals that ask a rank to stop. They also reach its helper processes (torchrun signals the
# rank's whole process group, Slurm every process of the step), which must outlive them: the rank
# still needs its checkpoint writer and its reward process to finish the step and its checkpoint.
HELPER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def helper_process_init() -> None:
    """Start of a helper process a rank spawns (megatron's checkpoint-writer manager): it ignores
    the stop signals (`HELPER_IGNORED_SIGNALS`) and dies with the rank."""
    for sig in HELPER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def _log_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.log"


def _exit_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.exit.json"


def _pgid_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.pgid"


class ConsoleOut:
    """Rank 0's stdout: the console while it lasts, then `fallback` (its log, or /dev/null).

    A launcher killed outright takes the console with it: a write then fails (EPIPE on a pipe, EIO
    on a hung-up terminal), which would raise into the trainer (rich even exits the process on a
    broken pipe). Instead fd 1 is pointed at `fallback` and the write retried there, so the rank
    finishes its step and its stop checkpoint. Everything else is the wrapped stream's.
    """

    def __init__(self, stream: TextIO, fallback: Path | None) -> None:
        self._stream, self._fallback = stream, fallback

    def _move(self) -> None:
        target = str(self._fallback) if self._fallback is not None else os.devnull
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, self._stream.fileno())
        os.close(fd)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._move()
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._move()
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _redirect_output(log_dir: Path, rank: int) -> None:
    fd = os.open(_log_path(log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    if rank != 0:
        sys.stdout.flush()
        os.dup2(fd, 1)
    os.close(fd)


def _write_exit(log_dir: Path, rank: int, code: int, error: str | None) -> None:
    path = _exit_path(log_dir, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "exit_code": code, "error": error}) + "\n")
    os.replace(tmp, path)


def _one_line(exc: BaseException) -> str:
    """'Type: first line of the message'; for an exception gathered from several ranks (torch's
    distributed-checkpoint CheckpointException carries `failures` {rank: (exception, trace)}), the
    first underlying exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"{type(exc).__name__}: {_one_line(inner)}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return int(exc.code or 0)
    print(exc.code, file=sys.stderr)
    return 1


def rank_main(main: Callable[[], int | None]) -> int:
    """Run one rank's `main` as described in the module docstring; returns its exit code, or, in a
    rank a launcher started, exits with it right away (`_leave`)."""
    rank = int(os.environ.get("RANK", "0"))
    launched = "RANK" in os.environ
    if launched:
        die_with_parent(signal.SIGKILL)  # a rank without its torchrun is an orphan
    log_dir = Path(os.environ[LOG_DIR_ENV]) if os.environ.get(LOG_DIR_ENV) else None
    if log_dir is not None:
        _redirect_output(log_dir, rank)
        _pgid_path(log_dir, rank).write_text(f"{os.getpgid(0)}\n")
    if rank == 0 and launched:
        sys.stdout = ConsoleOut(sys.stdout, _log_path(log_dir, rank) if log_dir else None)
    quiet_optional_backend_warnings()
    error = None
    try:
        code = int(main() or 0)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        traceback.print_exc()
        code, error = 1, _one_line(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    if log_dir is not None:
        _write_exit(log_dir, rank, code, error)
    if launched:
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """End a finished rank now. Its work is done and on disk (checkpoint, metrics, logs flushed,
    exit record written; its helper processes die with it), and the interpreter's teardown of
    torch, gloo and megatron-core took 8 s on a loaded 2-core box: longer than a rank that was
    asked to stop may take before it is killed."""
    os._exit(code)


# -- launcher side ------------------------------------------------------------------------------


def clear_logs(log_dir: str | os.PathLike) -> Path:
    """Create `log_dir` and remove the logs and exit records of an earlier launch into it."""
    path = Path(log_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    stale_files = [*path.glob("rank*.log"), *path.glob("rank*.exit.json"), *path.glob("rank*.pgid")]
    for stale in [*stale_files, path / TORCHRUN_LOG]:
        stale.unlink(missing_ok=True)
    shutil.rmtree(path / TORCHRUN_DIR, ignore_errors=True)
    return path


def rank_groups(log_dir: str | os.PathLike) -> list[int]:
    """The process groups the ranks of the last launch into `log_dir` ran in (never ours)."""
    groups = set()
    for path in Path(log_dir).glob("rank*.pgid"):
        try:
            groups.add(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(g for g in groups if g > 1 and g != os.getpgid(0))


def _records(log_dir: Path, nproc: int) -> dict[int, dict]:
    out = {}
    for rank in range(nproc):
        try:
            out[rank] = json.loads(_exit_path(log_dir, rank).read_text())
        except (OSError, ValueError):
            continue
    return out


def _signalled(log_dir: Path) -> dict[int, str]:
    """rank -> signal name, when torchrun's first observed failure is a rank killed by a signal
    (the ranks torchrun itself stops after a failure are consequences, not listed)."""
    try:
        text = (log_dir / TORCHRUN_LOG).read_text(errors="replace")
    except OSError:
        return {}
    _, found, text = text.rpartition("Root Cause (first observed failure):")
    if not found:
        return {}
    out = {}
    for rank, num in _SIGNALLED.findall(text):
        try:
            out[int(rank)] = signal.Signals(int(num)).name
        except ValueError:
            out[int(rank)] = f"signal {num}"
    return out


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:_MAX_LINE] if lines else ""


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def summarize(log_dir: str | os.PathLike, nproc: int) -> list[str]:
    """One line per distinct failure: `rank 1: killed by SIGKILL (log: .../rank1.log)`, ..."""
    log_dir = Path(log_dir)
    records = _records(log_dir, nproc)
    failures: dict[str, list[int]] = {}
    for rank, name in sorted(_signalled(log_dir).items()):
        if rank not in records:
            failures.setdefault(f"killed by {name}", []).append(rank)
    for rank, record in sorted(records.items()):
        if record.get("exit_code") == 0:
            continue
        what = record.get("error")
        if not what:
            last = _last_line(_log_path(log_dir, rank))
            what = f"exited with code {record.get('exit_code')}" + (f": {last}" if last else "")
        failures.setdefault(what, []).append(rank)
    if not failures:
        return [f"the ranks failed without reporting an error; see {log_dir / TORCHRUN_LOG}"]
    lost = [r for what, ranks in failures.items() if any(m in what for m in _PEER_LOST) for r in ranks]
    lines = [
        f"{_rank_list(ranks)}: {what} (log: {_log_path(log_dir, ranks[0])})"
        for what, ranks in failures.items()
        if not any(m in what for m in _PEER_LOST)
    ]
    if lost:
        lost.sort()
        lines.append(
            f"{_rank_list(lost)}: lost the connection to a failed peer (log: {_log_path(log_dir, lost[0])})"
        )
    return lines


def common_exit_code(log_dir: str | os.PathLike, nproc: int) -> int | None:
    """The exit code every failed rank chose itself (no exception, no signal), if they agree."""
    records = _records(Path(log_dir), nproc)
    failed = [r for r in records.values() if r.get("exit_code") != 0]
    codes = {int(r.get("exit_code") or 1) for r in failed}
    if not failed or any(r.get("error") for r in failed) or len(codes) != 1 or _signalled(Path(log_dir)):
        return None
    return codes.pop()
