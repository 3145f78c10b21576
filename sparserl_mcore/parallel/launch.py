"""Run a Python entry point on N local ranks with torchrun, as a real subprocess.

Tests and `--nproc` CLI flags use `launch_local`; it never imports torch, so callers stay cheap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence


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


def launch_local(
    argv: Sequence[str],
    nproc: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` (a script path or `-m module` plus its arguments) on `nproc` local ranks.

    OMP_NUM_THREADS defaults to 1 (ranks share the machine's cores). stdout and stderr are captured
    together; on a non-zero exit or a timeout a `LaunchError` with that output is raised.
    """
    cmd = torchrun_command(argv, nproc)
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        proc = subprocess.run(
            cmd,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise LaunchError(cmd, None, output) from exc
    if proc.returncode != 0:
        raise LaunchError(cmd, proc.returncode, proc.stdout)
    return proc
