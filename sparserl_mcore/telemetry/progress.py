"""Rich progress for a run: overall steps, and per step the rollouts generated and updates applied.

Disabled (non-host ranks, `telemetry.progress=false`, or no terminal) it does nothing, so the loop
calls it unconditionally.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class RunProgress:
    """Use as a context manager around the loop; `rollouts(n)` / `updates(n)` reset the inner bars."""

    def __init__(self, total_steps: int, *, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not enabled,
        )
        self._steps = self._progress.add_task("steps", total=total_steps, info="")
        self._rollouts = self._progress.add_task("rollouts", total=None, info="", visible=False)
        self._updates = self._progress.add_task("updates", total=None, info="", visible=False)

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()

    def _reset(self, task: TaskID, total: int) -> None:
        self._progress.reset(task, total=total, visible=True, info="")

    def rollouts(self, total: int) -> None:
        """A new rollout batch of `total` sequences starts."""
        self._reset(self._rollouts, total)

    def advance_rollouts(self, n: int = 1) -> None:
        self._progress.advance(self._rollouts, n)

    def updates(self, total: int) -> None:
        """Up to `total` optimizer updates (K epochs x updates per epoch) on the current batch."""
        self._reset(self._updates, total)

    def advance_updates(self, n: int = 1, *, info: str = "") -> None:
        self._progress.update(self._updates, advance=n, info=info)

    def step_done(self, step: int, info: str = "") -> None:
        """Mark the run at `step` completed steps (also right after a resume), with a one-line summary."""
        self._progress.update(self._steps, completed=step, info=info)
