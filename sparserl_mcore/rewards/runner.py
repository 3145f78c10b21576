"""Run a reward function where a hung call can be abandoned, and refuse rewards that are not numbers.

A verifier is user code: a regex that backtracks forever holds the GIL, so a thread cannot bound it.
`RewardRunner` runs it in a process of its own (`rewards.worker`, started at the first call), one
call at a time over pipes. A call not answered within `timeout_s` kills that process (the next call
starts a fresh one) and raises `RewardError` naming the reward and the sample; so do a reward that
raises, one that returns something other than a number, and, unless `skip_nonfinite`, a NaN or
infinite reward (or one too large for the float32 the batch holds). With `skip_nonfinite` such a
reward comes back as NaN, for the caller to drop and count.

    runner = RewardRunner("math_boxed", {}, timeout_s=60.0)
    value = runner("... \\boxed{4}", "4", sample="step3-p0-g1")
    runner.close()
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from sparserl_mcore.parallel.rank_entry import HELPER_IGNORED_SIGNALS

FLOAT32_MAX = 3.4028234663852886e38
START_TIMEOUT_S = 120.0  # importing the reward's module (and torch, if it uses it) on a loaded box


def spawn_worker() -> subprocess.Popen[str]:
    """Start `rewards.worker` with the stop signals blocked, so it ignores them from its first
    instruction: a stop signal reaching it while the interpreter starts (torchrun signals the
    rank's process group, Slurm every process of the step) would end it, and with it the step the
    stopping rank still has to finish. It sets them to ignored, then unblocks them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORED_SIGNALS)
    try:  # in this thread only: a stop signal meanwhile goes to another thread, or waits for the mask
        return subprocess.Popen(
            [sys.executable, "-m", "sparserl_mcore.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class RewardError(RuntimeError):
    """A reward call failed; the message is one line naming the reward and the sample."""


class RewardRunner:
    """Callable `(completion, answer, *, sample) -> float`; thread-safe (calls take turns)."""

    def __init__(
        self, name: str, kwargs: Mapping[str, Any], *, timeout_s: float, skip_nonfinite: bool = False
    ) -> None:
        self.name, self.kwargs = name, dict(kwargs)
        self.timeout_s, self.skip_nonfinite = timeout_s, skip_nonfinite
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def __call__(self, completion: str, answer: str, *, sample: str) -> float:
        with self._lock:
            reply = self._ask({"completion": completion, "answer": answer}, sample)
        if "error" in reply:
            raise RewardError(f"reward {self.name} {reply['error']} (sample {sample})")
        value = float(reply["reward"])
        if math.isfinite(value) and abs(value) <= FLOAT32_MAX:
            return value
        if self.skip_nonfinite:
            return math.nan
        raise RewardError(
            f"reward {self.name} returned {value!r} for sample {sample} (completion "
            f"{completion[:40]!r}): a reward must be a finite float32; fix the reward, or set "
            "reward.skip_nonfinite=true to drop such groups, counted"
        )

    def _ask(self, request: Mapping[str, Any], sample: str) -> dict[str, Any]:
        proc = self._started(sample)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died(sample)
        line = self._read_line(proc, self.timeout_s)
        if line is None:
            self.close()
            raise RewardError(
                f"reward {self.name} did not return within reward.timeout_s={self.timeout_s:g} s for "
                f"sample {sample}; the call was abandoned (its process killed)"
            )
        return json.loads(line) if line else self._died(sample)

    def _started(self, sample: str) -> subprocess.Popen[str]:
        """The reward process, started (and its reward built) if it is not running."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = proc = spawn_worker()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"name": self.name, "kwargs": self.kwargs}) + "\n")
        proc.stdin.flush()
        line = self._read_line(proc, max(START_TIMEOUT_S, self.timeout_s))
        reply = json.loads(line) if line else {"error": "did not start"}
        if not reply.get("ready"):
            self.close()
            raise RewardError(f"reward {self.name} {reply.get('error', 'did not start')} (sample {sample})")
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str | None:
        """The process's next line ("" when it exited), or None when none came within timeout_s."""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:  # one request in flight: the line arrives whole, written and flushed at once
                return proc.stdout.readline()

    def _died(self, sample: str) -> dict[str, Any]:
        code = self._proc.wait() if self._proc is not None else None
        self.close()
        raise RewardError(f"reward {self.name}: its process exited (code {code}) scoring sample {sample}")

    def close(self) -> None:
        """Kill the reward process, if one runs."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
