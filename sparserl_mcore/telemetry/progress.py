"""The run's one live progress line: steps done, elapsed and remaining time, the last step's reward,
and what the current step is doing (rollouts n/N, update, sync, eval).

Disabled (non-host ranks, `telemetry.progress=false`) it does nothing, so the loop calls it
unconditionally. Rollout progress may be reported from the engine pool's threads (rich's Progress
is thread-safe).
"""

from __future__ import annotations

import threading
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class RunProgress:
    """Use as a context manager around the loop; `rollouts(n)` starts a counted phase of the current
    step, `phase(text)` names one without a count, `step_done` closes the step."""

    def __init__(self, total_steps: int, *, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]GRPO[/]"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("[dim]{task.fields[phase]}[/]"),
            console=console,
            disable=not enabled,
            speed_estimate_period=120.0,  # steps take seconds: average the ETA over several
        )
        self._task = self._progress.add_task("steps", total=total_steps, info="", phase="")
        self._lock = threading.Lock()
        self._name, self._done, self._total = "", 0, 0
        self._started = False

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()

    def _show(self) -> None:
        text = f"{self._name} {self._done}/{self._total}" if self._total else self._name
        self._progress.update(self._task, phase=text)

    def _start(self, name: str, total: int) -> None:
        with self._lock:
            self._name, self._done, self._total = name, 0, total
            self._show()

    def phase(self, name: str) -> None:
        """The current step is doing `name` (no count): "eval", "sync", ..."""
        self._start(name, 0)

    def rollouts(self, total: int) -> None:
        """A new rollout batch of `total` sequences starts."""
        self._start("rollouts", total)

    def advance_rollouts(self, n: int = 1) -> None:
        with self._lock:
            self._done += n
            self._show()

    def step_done(self, step: int, info: str = "") -> None:
        """Mark the run at `step` completed steps (also right after a resume), with a short summary."""
        with self._lock:
            self._name, self._done, self._total = "", 0, 0
            if not self._started:  # a resumed run's earlier steps took no time here: not in the ETA
                self._progress.reset(self._task, completed=step, info=info, phase="")
                self._started = True
            else:
                self._progress.update(self._task, completed=step, info=info, phase="")
