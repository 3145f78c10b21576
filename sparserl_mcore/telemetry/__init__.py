"""Telemetry: metric sinks (JSONL, TensorBoard, W&B), NVML GPU stats, rich progress, the run plot."""

from sparserl_mcore.telemetry.gpu import GpuMonitor
from sparserl_mcore.telemetry.logger import MetricsLogger
from sparserl_mcore.telemetry.plot import PANELS, plot_metrics, read_metrics
from sparserl_mcore.telemetry.progress import RunProgress
from sparserl_mcore.telemetry.sinks import JsonlSink, MetricsSink, TensorBoardSink, WandbSink

__all__ = [
    "PANELS",
    "GpuMonitor",
    "JsonlSink",
    "MetricsLogger",
    "MetricsSink",
    "RunProgress",
    "TensorBoardSink",
    "WandbSink",
    "plot_metrics",
    "read_metrics",
]
