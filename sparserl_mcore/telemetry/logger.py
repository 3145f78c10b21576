"""`MetricsLogger`: the one object the trainer logs through on its host rank.

It fans each step's scalars out to the configured sinks (JSONL always, TensorBoard, W&B), adds
GPU memory/utilisation when there is a GPU, prints a one-line summary per step, records events
(engine failures, skipped non-finite steps, ...) in the JSONL file, and draws the PNG at close.
On other ranks build it with `enabled=False`: every method is then a no-op.

    logger = MetricsLogger(cfg.telemetry, run_config=to_dict(cfg))
    logger.log({"rollout/reward_mean": 0.4, ...}, step=3)
    logger.event("engine_failed", {"url": url, "retried": 12})
    paths = logger.close()        # {"metrics": .../metrics.jsonl, "plot": .../summary.png}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparserl_mcore.config import TelemetryConfig
from sparserl_mcore.telemetry.gpu import GpuMonitor
from sparserl_mcore.telemetry.plot import plot_metrics
from sparserl_mcore.telemetry.sinks import JsonlSink, MetricsSink, TensorBoardSink, WandbSink

# What the one-line step summary shows: label -> metric key.
SUMMARY = {
    "reward": "rollout/reward_mean",
    "eval(dense)": "eval/pass1_dense",
    "eval(comp)": "eval/pass1_compressed",
    "kl": "policy/kl",
    "|dlogp|": "correction/abs_logp_diff_mean",
    "gates": "dgg/gates",
    "vetoed": "correction/vetoed_sequences",
    "kv": "rollout/peak_kv_bytes",
    "sync": "sync/patch_bytes",
}


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
    ) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.dir = Path(cfg.dir)
        self.path = self.dir / "metrics.jsonl"
        self._sinks: list[MetricsSink] = []
        if not enabled:
            return
        from rich.console import Console

        self.console = Console()
        self._jsonl = JsonlSink(self.path)
        self._sinks.append(self._jsonl)
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(self.dir / "tensorboard"))
        if cfg.wandb_project:
            self._sinks.append(WandbSink(cfg.wandb_project, cfg.wandb_run_name, run_config or {}, self.dir))
        self._gpu = GpuMonitor(device_index, enabled=cfg.gpu_stats)

    def log(self, metrics: Mapping[str, float], *, step: int) -> dict[str, float]:
        """Write one step's metrics (plus GPU stats) to every sink; returns what was written."""
        if not self.enabled:
            return {}
        record = {k: float(v) for k, v in metrics.items()}
        record.update(self._gpu.sample())
        for sink in self._sinks:
            sink.write(step, record)
        if self.cfg.progress:
            parts = [f"{label}={record[key]:.4g}" for label, key in SUMMARY.items() if key in record]
            self.console.print(f"[bold cyan]step {step}[/] " + " ".join(parts), soft_wrap=True)
        return record

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Record a discrete event (JSONL line with "event": kind) and show it."""
        if not self.enabled:
            return
        plain = {k: _plain(v) for k, v in fields.items()}
        self._jsonl.event(kind, plain)
        self.console.print(f"[yellow]event[/] {kind}: {plain}", soft_wrap=True)

    def close(self) -> dict[str, Path]:
        """Close the sinks and draw the plot; returns the paths written."""
        if not self.enabled:
            return {}
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        paths = {"metrics": self.path}
        if self.cfg.plot and self.path.is_file() and self.path.stat().st_size:
            paths["plot"] = plot_metrics(self.path, self.dir / "summary.png")
        return paths
