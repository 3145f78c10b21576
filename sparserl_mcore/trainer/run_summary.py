"""How a run ended: its exit code, the summary the host rank prints last, and each step's short
progress note.

Exit codes (also `sparserl train`'s): 0 done or stopped cleanly by a signal, 3 no rollout engine
left, 4 a reward failed (raised, hung past reward.timeout_s, or returned a non-finite value), 5
train.max_empty_steps consecutive steps trained nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

EXIT_OK, EXIT_NO_ENGINE, EXIT_REWARD, EXIT_NOTHING_TRAINED = 0, 3, 4, 5


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """How a run ended; `report()` is what the host rank prints last."""

    exit_code: int
    steps: int
    metrics_path: Path | None = None
    plot_path: Path | None = None
    checkpoint_path: Path | None = None
    hf_path: Path | None = None
    message: str = ""
    first_step: int = 0  # the step this run started from (> 0 when it resumed)
    seconds: float = 0.0
    rewards: tuple[float, float] | None = None  # mean reward of this run's first and last step
    stopped_by: str | None = None  # the signal that ended the run early ("SIGINT", "SIGTERM", "SIGUSR1")
    updates: int = 0  # optimizer updates applied by this run

    def report(self) -> list[str]:
        """A short summary and the paths a user looks at next (those this run wrote)."""
        if self.stopped_by:
            head = f"stopped by {self.stopped_by}"
        else:
            head = "done" if self.exit_code == EXIT_OK else f"stopped (exit code {self.exit_code})"
        line = f"{head}: steps {self.first_step} -> {self.steps} in {_duration(self.seconds)}"
        if self.rewards is not None:
            line += f", reward {self.rewards[0]:.3f} -> {self.rewards[1]:.3f}"
        line += f", {self.updates} optimizer update{'' if self.updates == 1 else 's'} applied"
        if self.stopped_by:
            line += (
                "; rerun the same command to resume"
                if self.checkpoint_path
                else "; no checkpoint.dir: nothing saved"
            )
        paths = {
            "metrics": self.metrics_path,
            "plot": self.plot_path,
            "checkpoint": self.checkpoint_path,
            "HF export": self.hf_path,
        }
        return [line] + [f"  {name + ':':<12}{path}" for name, path in paths.items() if path is not None]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def step_info(metrics: Mapping[str, float]) -> str:
    """The progress line's note on a finished step: its reward and how many sequences it trained."""
    trained = f"trained {metrics.get('train/sequences', 0):.0f}"
    if "rollout/reward_mean" not in metrics:
        return trained
    return f"reward {metrics['rollout/reward_mean']:.3f}, {trained}"
