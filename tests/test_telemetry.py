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
from sparserl_mcore.telemetry.console import human_bytes, times
from sparserl_mcore.telemetry.logger import step_line
from sparserl_mcore.telemetry.plot import drawable_panels


def _write_jsonl(path: Path) -> None:
    keys = {
        k for _, series, _ in PANELS for key, _ in series for k in ([key] if isinstance(key, str) else key)
    }
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


def test_only_logged_panels_are_drawn_and_ratios_divide_their_two_metrics() -> None:
    records = [
        {
            "step": s,
            "rollout/reward_mean": 0.1 * s,
            "rollout/peak_kv_bytes": 16384.0,
            "rollout/dense_kv_bytes": 28672.0,
        }
        for s in (1, 2)
    ]
    records[1]["sync/patch_bytes"], records[1]["sync/dense_bytes"] = 4.0, 20.0
    panels = {title: curves for title, curves, _ in drawable_panels(records)}
    assert set(panels) == {
        "train reward (mean)",
        "saved vs dense (x less)",
        "peak KV bytes / request",
        "weight sync bytes / step",
    }  # no eval, KL, mismatch, DGG or correction panel: never logged
    saved = {label: data for data, label in panels["saved vs dense (x less)"]}
    assert saved == {"peak KV / request": ([1, 2], [1.75, 1.75]), "weight sync bytes": ([2], [5.0])}


def test_step_lines_are_short_and_human() -> None:
    line = step_line(
        12,
        {
            "rollout/reward_mean": 0.2134,
            "rollout/peak_kv_bytes": 16384.0,
            "rollout/dense_kv_bytes": 28672.0,
            "sync/patch_bytes": 83968.0,
            "sync/dense_bytes": 430080.0,
            "dgg/gates": 1.0,
            "correction/vetoed_sequences": 0.0,
            "time/rollout_s": 1.0,
            "time/update_s": 3.1,
        },
    )
    assert line == "step 12  reward 0.213  KV 16.4 KB (1.8x less)  sync 84.0 KB (5.1x less)  gated 1  4.1 s"
    assert step_line(0, {"eval/pass1_compressed": 0.0625, "eval/pass1_dense": 0.5}) == (
        "step 0  eval 0.062 compressed KV / 0.500 dense KV"
    )
    outer = {"diloco/payload_bytes": 90_000.0, "diloco/dense_bytes": 1_118_720.0}  # DiLoCo islands
    assert step_line(4, outer) == "step 4  outer 90.0 KB (12x less)"
    timed = {"time/rollout_s": 1.0, "time/update_s": 3.1, "time/step_s": 4.6}
    assert step_line(3, timed) == "step 3  4.6 s"  # the step's wall time, not the phases summed again
    assert human_bytes(999) == "999 B" and human_bytes(1.5e6) == "1.5 MB" and human_bytes(250_000) == "250 KB"
    assert times(3.21) == "3.2x" and times(41.7) == "42x"


def test_logger_writes_jsonl_tensorboard_and_plot(tmp_path: Path) -> None:
    cfg = TelemetryConfig(dir=str(tmp_path / "run"), tensorboard=True, progress=False)
    logger = MetricsLogger(cfg, run_config={"train": {"steps": 2}})
    written = logger.log({"rollout/reward_mean": 0.25, "policy/kl": float("nan")}, step=1)
    assert written["rollout/reward_mean"] == 0.25 and not any(k.startswith("gpu/") for k in written)
    logger.event("nonfinite_step", {"step": 1, "path": tmp_path})
    logger.event("diloco_outer_step", {"step": 1}, show=False)  # the JSONL only
    logger.log({"rollout/reward_mean": 0.5}, step=2)
    paths = logger.close()
    records = [json.loads(line) for line in paths["metrics"].read_text().splitlines()]
    assert [(r.get("event"), r.get("step")) for r in records] == [
        (None, 1),
        ("nonfinite_step", 1),
        ("diloco_outer_step", 1),
        (None, 2),
    ]
    assert records[0]["policy/kl"] is None and records[1]["path"] == str(tmp_path)
    assert [r["step"] for r in read_metrics(paths["metrics"])] == [1, 2]  # events are not steps
    assert paths["plot"].is_file()  # only the reward panel has data: one panel
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_disabled_logger_and_progress_do_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(TelemetryConfig(dir=str(tmp_path / "off")), enabled=False)
    assert logger.log({"a": 1.0}, step=1) == {} and logger.close() == {}
    assert not (tmp_path / "off").exists()
    with RunProgress(3, enabled=False) as progress:
        progress.rollouts(8)
        progress.advance_rollouts(8)
        progress.phase("update")
        progress.step_done(1)


def test_gpu_monitor_is_silent_without_a_gpu() -> None:
    monitor = GpuMonitor(0)
    sample = monitor.sample()
    assert (
        sample == {}
        if not monitor.available
        else set(sample) == {"gpu/mem_used_gib", "gpu/mem_total_gib", "gpu/util_pct"}
    )


def test_demo_summary_table_shows_start_end_and_savings(tmp_path: Path) -> None:
    from rich.console import Console

    from sparserl_mcore.demo import summary_table

    rows = [{"step": 0, "eval/pass1_compressed": 0.05, "eval/pass1_dense": 0.04}]
    for s in range(1, 11):
        rows.append(
            {
                "step": s,
                "rollout/reward_mean": 0.1 if s <= 5 else 0.3,
                "rollout/peak_kv_bytes": 8192.0,
                "rollout/dense_kv_bytes": 18432.0,
                "sync/patch_bytes": 50_000.0,
                "sync/dense_bytes": 250_000.0,
                "train/updates": 4.0,
                "dgg/gates": 1.0 if s % 2 else 0.0,
                "correction/vetoed_sequences": 2.0,
                "train/sequences": 128.0,
            }
        )
    rows.append({"step": 10, "eval/pass1_compressed": 0.45, "eval/pass1_dense": 0.5})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    console = Console(record=True, width=140)
    console.print(summary_table(path))
    text = console.export_text()
    for expected in (
        "0.100 -> 0.300",
        "0.050 -> 0.450 (+0.400)",
        "0.040 -> 0.500 (+0.460)",
        "8.2 KB vs 18.4 KB (2.2x less)",
        "500 KB vs 2.5 MB (5.0x less)",
        "40 / 5",
        "20 of 1280",
    ):
        assert expected in text, text
