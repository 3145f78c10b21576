"""Run a Python entry point on N local ranks with torchrun, as a real subprocess.

Tests and `--nproc` CLI flags use `launch_local`; it never imports torch, so callers stay cheap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil


class LaunchError(RuntimeError):
    """A torchrun launch failed; the message carries the command, exit code and captured output."""

    def __init__(self, cmd: Sequence[str], returncode: int | None, output: str) -> None:
        status = "timed out" if returncode is None else f"exited with code {returncode}"
        super().__init__(f"{' '.join(cmd)} {status}\n--- output ---\n{output}")
        self.returncode = returncode
        self.output = output


def torchrun_command(argv: Sequence[str], nproc: int) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node N <argv>` for this interpreter."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: must be >= 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, and wait for them to go."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


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
    (or an interrupt) kills torchrun and every rank: torchrun starts each rank in its own session,
    so the process tree is walked rather than a process group signalled.
    """
    cmd = torchrun_command(argv, nproc)
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with subprocess.Popen(
        cmd,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
