"""`MetricsLogger`: the one object the trainer logs through on its host rank.

It fans each step's scalars out to the configured sinks (JSONL always, TensorBoard, W&B), adds
GPU memory/utilisation when there is a GPU, prints a short human-formatted line per step (above
the live progress line, through the same console), records events (engine failures, skipped
non-finite steps, ...) in the JSONL file, and draws the PNG at close.
On other ranks build it with `enabled=False`: every method is then a no-op. A run that resumes from
a checkpoint at step S passes `resume_step=S`: metrics.jsonl and updates.jsonl keep their history
up to S and drop what the interrupted run logged after it (`sinks.JsonlSink`); without it the files
start empty.

    logger = MetricsLogger(cfg.telemetry, run_config=to_dict(cfg))
    logger.log({"rollout/reward_mean": 0.4, ...}, step=3)
    logger.event("engine_failed", {"url": url, "retried": 12})
    logger.log_updates([{"dwd/lm_head_rel_change": 2e-3, "dgg/z": 0.4, ...}, ...], step=3)
    paths = logger.close()        # {"metrics": .../metrics.jsonl, "plot": .../summary.png}

Per-optimizer-update records (the DWD / DGG signal: weight change of lm_head and the middle
layers, lm_head gradient energy and z-score, reuse index, gate decision) go to updates.jsonl
only, one line per update with its step and index in the step: TensorBoard and W&B plot against
the step, and their step-level means are in the step record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape

from sparserl_mcore.config import TelemetryConfig
from sparserl_mcore.telemetry.console import human_bytes, times
from sparserl_mcore.telemetry.gpu import GpuMonitor
from sparserl_mcore.telemetry.plot import plot_metrics
from sparserl_mcore.telemetry.sinks import JsonlSink, MetricsSink, TensorBoardSink, WandbSink


def _saving(record: Mapping[str, float], used: str, dense: str, label: str) -> str | None:
    """'KV 16.4 KB (1.8x less)': bytes used, and how many times fewer than dense."""
    if used not in record:
        return None
    ratio = f" ({times(record[dense] / record[used])} less)" if record.get(dense) and record[used] else ""
    return f"{label} {human_bytes(record[used])}{ratio}"


def step_line(step: int, record: Mapping[str, float], *, async_mode: str = "off") -> str:
    """The one console line of a step: reward, sequences trained, the async mode and the lag of the
    trained tokens (async runs), eval (on eval steps), KV, sync and (islands) outer-step bytes
    against dense, DGG gates and vetoed sequences when there were any, wall time."""
    parts = [f"step {step}"]
    if "rollout/reward_mean" in record:
        parts.append(f"reward {record['rollout/reward_mean']:.3f}")
    if "train/sequences" in record:
        parts.append(f"trained {record['train/sequences']:.0f} seq")
    if async_mode != "off":
        lag = record.get("staleness/lag_mean")
        parts.append(
            f"{async_mode} lag {lag:.2f} (max {record.get('staleness/lag_max', 0):.0f})"
            if lag is not None
            else async_mode
        )
    evals = [
        f"{record[k]:.3f} {name} KV"
        for k, name in (("eval/pass1_compressed", "compressed"), ("eval/pass1_dense", "dense"))
        if k in record
    ]
    if evals:
        parts.append("eval " + " / ".join(evals))
    for used, dense, label in (
        ("rollout/peak_kv_bytes", "rollout/dense_kv_bytes", "KV"),
        ("sync/patch_bytes", "sync/dense_bytes", "sync"),
        ("diloco/payload_bytes", "diloco/dense_bytes", "outer"),  # DiLoCo islands' outer steps
    ):
        saving = _saving(record, used, dense, label)
        if saving:
            parts.append(saving)
    for key, label in (("dgg/gates", "gated"), ("correction/vetoed_sequences", "vetoed")):
        if record.get(key):
            parts.append(f"{label} {record[key]:.0f}")
    # the step's wall time; records without it (older runs) sum their phases
    seconds = record.get("time/step_s") or sum(v for k, v in record.items() if k.startswith("time/"))
    if seconds:
        parts.append(f"{seconds:.1f} s")
    return "  ".join(parts)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else str(value)


class MetricsLogger:
    def __init__(
        self,
        cfg: TelemetryConfig,
        *,
        enabled: bool = True,
        run_config: Mapping[str, Any] | None = None,
        device_index: int = 0,
        resume_step: int | None = None,
        async_mode: str = "off",
    ) -> None:
        self.cfg, self.enabled, self.async_mode = cfg, enabled, async_mode
        self.dir = Path(cfg.dir)
        self.path = self.dir / "metrics.jsonl"
        self._sinks: list[MetricsSink] = []
        if not enabled:
            return
        from rich.console import Console

        self.console = Console()
        self._jsonl = JsonlSink(self.path, keep_through_step=resume_step)
        self._sinks.append(self._jsonl)
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(self.dir / "tensorboard"))
        if cfg.wandb_project:
            self._sinks.append(WandbSink(cfg.wandb_project, cfg.wandb_run_name, run_config or {}, self.dir))
        self._gpu = GpuMonitor(device_index, enabled=cfg.gpu_stats)
        self._updates: JsonlSink | None = None  # updates.jsonl, opened at the first update
        if resume_step is not None:  # its history through the checkpoint is kept, as metrics.jsonl's
            self._updates = JsonlSink(self.dir / "updates.jsonl", keep_through_step=resume_step)

    def log_updates(self, updates: Sequence[Mapping[str, float]], *, step: int) -> None:
        """One updates.jsonl line per optimizer update of `step`: {"step", "update" (1-based), ...}."""
        if not self.enabled or not updates:
            return
        if self._updates is None:
            self._updates = JsonlSink(self.dir / "updates.jsonl")
        for index, record in enumerate(updates, 1):
            self._updates.write(step, {"update": float(index), **{k: float(v) for k, v in record.items()}})

    def log(self, metrics: Mapping[str, float], *, step: int) -> dict[str, float]:
        """Write one step's metrics (plus GPU stats) to every sink; returns what was written."""
        if not self.enabled:
            return {}
        record = {k: float(v) for k, v in metrics.items()}
        record.update(self._gpu.sample())
        for sink in self._sinks:
            sink.write(step, record)
        if self.cfg.progress:
            self.console.print(
                step_line(step, record, async_mode=self.async_mode), highlight=False, soft_wrap=True
            )
        return record

    def event(self, kind: str, fields: Mapping[str, Any], *, show: bool = True) -> None:
        """Record a discrete event (JSONL line with "event": kind) and show it (unless `show` is
        false: routine records, e.g. each DiLoCo outer step, stay out of the console)."""
        if not self.enabled:
            return
        plain = {k: _plain(v) for k, v in fields.items()}
        self._jsonl.event(kind, plain)
        if not show:
            return
        detail = escape(", ".join(f"{k}={v}" for k, v in plain.items()))
        self.console.print(f"[yellow]{kind.replace('_', ' ')}[/]: {detail}", soft_wrap=True)

    def close(self) -> dict[str, Path]:
        """Close the sinks and draw the plot; returns the paths written."""
        if not self.enabled:
            return {}
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._updates is not None:
            self._updates.close()
            self._updates = None
        paths = {"metrics": self.path}
        if self.cfg.plot and self.path.is_file() and self.path.stat().st_size:
            paths["plot"] = plot_metrics(self.path, self.dir / "summary.png")
        return paths
