"""Metric sinks: where one step's scalars go. JSONL always; TensorBoard and W&B when configured.

A sink takes `write(step, metrics)` with plain float metrics and `close()`. TensorBoard and W&B are
imported only when their sink is built, so a run that does not use them never needs them.
"""

from __future__ import annotations

import json
import math
import os
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

    Each line is flushed as written, so a killed run keeps every completed step. A run that resumes
    from a checkpoint at step S (`keep_through_step=S`) keeps the file's history up to that
    checkpoint and drops what the interrupted run logged after it (the steps this run does again),
    so every step is in the file once; a run that starts over (None) starts an empty file. Either
    way the file is rewritten whole (temp file + rename) before anything is appended.
    """

    def __init__(self, path: str | Path, *, keep_through_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = _history(self.path, keep_through_step) if keep_through_step is not None else []
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
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


def _history(path: Path, step: int) -> list[str]:
    """The lines of `path` logged up to a checkpoint at `step`: everything before the first record
    of a later step (a run logs in order; an unreadable line, e.g. one cut by a kill, is dropped)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("step"), int) and record["step"] > step:
            break
        kept.append(line if line.endswith("\n") else line + "\n")
    return kept


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
