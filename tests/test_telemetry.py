"""Telemetry: JSONL records and events, TensorBoard event files, silent GPU stats on CPU, the plot."""

from __future__ import annotations

import json
from pathlib import Path

from sparserl_mcore.config import TelemetryConfig
from sparserl_mcore.telemetry import (
    PANELS,
    GpuMonitor,
    MetricsLogger,
    RunProgress,
    plot_metrics,
    read_metrics,
)


def _write_jsonl(path: Path) -> None:
    keys = [key for _, series, _ in PANELS for key, _ in series]
    lines = [json.dumps({"step": s, "time": 0.0, **{k: 1.0 + s * 0.1 for k in keys}}) for s in range(1, 6)]
    lines.insert(2, json.dumps({"event": "engine_failed", "url": "http://x"}))
    lines.append(json.dumps({"step": 6, "rollout/reward_mean": None}))  # NaN written as null
    lines.append('{"step": 7, "rollout/rew')  # a run killed mid-write
    path.write_text("\n".join(lines))


def test_plot_from_a_small_jsonl(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    _write_jsonl(metrics)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]
    out = plot_metrics(metrics, tmp_path / "plots" / "summary.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert [p.name for p in out.parent.iterdir()] == ["summary.png"]  # no temp file left


def test_logger_writes_jsonl_tensorboard_and_plot(tmp_path: Path) -> None:
    cfg = TelemetryConfig(dir=str(tmp_path / "run"), tensorboard=True, progress=False)
    logger = MetricsLogger(cfg, run_config={"train": {"steps": 2}})
    written = logger.log({"rollout/reward_mean": 0.25, "policy/kl": float("nan")}, step=1)
    assert written["rollout/reward_mean"] == 0.25 and not any(k.startswith("gpu/") for k in written)
    logger.event("nonfinite_step", {"step": 1, "path": tmp_path})
    logger.log({"rollout/reward_mean": 0.5}, step=2)
    paths = logger.close()
    records = [json.loads(line) for line in paths["metrics"].read_text().splitlines()]
    assert [(r.get("event"), r.get("step")) for r in records] == [(None, 1), ("nonfinite_step", 1), (None, 2)]
    assert records[0]["policy/kl"] is None and records[1]["path"] == str(tmp_path)
    assert [r["step"] for r in read_metrics(paths["metrics"])] == [1, 2]  # events are not steps
    assert paths["plot"].is_file()  # most panels were never logged: drawn as "not logged"
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_disabled_logger_and_progress_do_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(TelemetryConfig(dir=str(tmp_path / "off")), enabled=False)
    assert logger.log({"a": 1.0}, step=1) == {} and logger.close() == {}
    assert not (tmp_path / "off").exists()
    with RunProgress(3, enabled=False) as progress:
        progress.rollouts(8)
        progress.advance_rollouts(8)
        progress.updates(4)
        progress.advance_updates(info="gated")
        progress.step_done(1)


def test_gpu_monitor_is_silent_without_a_gpu() -> None:
    monitor = GpuMonitor(0)
    sample = monitor.sample()
    assert (
        sample == {}
        if not monitor.available
        else set(sample) == {"gpu/mem_used_gib", "gpu/mem_total_gib", "gpu/util_pct"}
    )
