"""Metric sinks: where one step's scalars go. JSONL always; TensorBoard and W&B when configured.

A sink takes `write(step, metrics)` with plain float metrics and `close()`. TensorBoard and W&B are
imported only when their sink is built, so a run that does not use them never needs them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class MetricsSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _json_value(value: float) -> float | None:
    """JSON has no NaN/Inf: write null so every line stays valid JSON for any reader."""
    return value if math.isfinite(value) else None


class JsonlSink:
    """One JSON object per line: {"step": N, "time": unix_s, "<metric>": value, ...}; events too.

    Each line is flushed as written, so a killed run keeps every completed step.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def _line(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._line({"step": step, "time": time.time(), **{k: _json_value(v) for k, v in metrics.items()}})

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        self._line({"event": kind, "time": time.time(), **fields})

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars into a TensorBoard event file under `logdir` (needs the tensorboard package)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                "telemetry.tensorboard=true needs the tensorboard package: "
                "pip install 'sparserl-mcore[logging]'"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(logdir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run (needs the wandb package and the user's own login)."""

    def __init__(self, project: str, run_name: str | None, config: Mapping[str, Any], run_dir: Path) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(
                f"telemetry.wandb_project={project!r} needs the wandb package: "
                "pip install 'sparserl-mcore[logging]'"
            ) from exc
        self._run = wandb.init(project=project, name=run_name, config=dict(config), dir=str(run_dir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
