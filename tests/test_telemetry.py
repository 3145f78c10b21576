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
from sparserl_mcore.telemetry.plot import GATED, drawable_panels, update_panels


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
    # an asynchronous run (train.async) logs the lag of its trained tokens: it gets a staleness panel
    records[1].update({"staleness/lag_mean": 0.75, "staleness/lag_max": 1.0})
    panels = {title: curves for title, curves, _ in drawable_panels(records)}
    lag = {label: data for data, label in panels["staleness: lag of trained tokens"]}
    assert lag == {"mean lag": ([2], [0.75]), "max lag": ([2], [1.0])}


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
            "train/sequences": 48.0,
            "time/rollout_s": 1.0,
            "time/update_s": 3.1,
        },
    )
    assert line == (
        "step 12  reward 0.213  trained 48 seq  KV 16.4 KB (1.8x less)  sync 84.0 KB (5.1x less)  "
        "gated 1  4.1 s"
    )
    # asynchronous: the mode and the lag of the trained tokens (none trained: the mode alone)
    lagged = {"train/sequences": 16.0, "staleness/lag_mean": 0.4375, "staleness/lag_max": 1.0}
    assert (
        step_line(5, lagged, async_mode="in_flight") == "step 5  trained 16 seq  in_flight lag 0.44 (max 1)"
    )
    assert step_line(6, {"train/sequences": 0.0}, async_mode="one_step") == "step 6  trained 0 seq  one_step"
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


def test_per_update_records_go_to_updates_jsonl_and_their_panels(tmp_path: Path) -> None:
    cfg = TelemetryConfig(dir=str(tmp_path / "run"), progress=False)
    logger = MetricsLogger(cfg)
    applied = {"dwd/lm_head_rel_change": 4e-3, "dwd/middle_rel_change": 1e-3, "dwd/ratio": 4.0}
    step1 = [
        {"dgg/reuse_index": 1.0, "dgg/gated": 0.0, "dgg/lm_head_grad_norm": 2.0, **applied},
        {"dgg/reuse_index": 2.0, "dgg/gated": 0.0, "dgg/z": 0.3, "dgg/lm_head_grad_norm": 2.5, **applied},
    ]
    step2 = [
        {"dgg/reuse_index": 1.0, "dgg/gated": 0.0, "dgg/z": -0.2, "dgg/lm_head_grad_norm": 1.5, **applied},
        {"dgg/reuse_index": 2.0, "dgg/gated": 0.0, "dgg/z": 0.1, "dgg/lm_head_grad_norm": 1.6, **applied},
        {"dgg/reuse_index": 3.0, "dgg/gated": 1.0, "dgg/z": 2.5, "dgg/lm_head_grad_norm": 9.0},
    ]
    for step, updates in ((1, step1), (2, step2)):
        logger.log({"rollout/reward_mean": 0.1 * step}, step=step)
        logger.log_updates(updates, step=step)
    paths = logger.close()
    rows = read_metrics(tmp_path / "run" / "updates.jsonl")
    assert [(r["step"], r["update"], r["dgg/reuse_index"]) for r in rows] == [
        (1, 1, 1),
        (1, 2, 2),
        (2, 1, 1),
        (2, 2, 2),
        (2, 3, 3),
    ]
    assert [r["step"] for r in read_metrics(paths["metrics"])] == [1, 2]  # step records untouched
    panels = {
        title: dict((label, data) for data, label in curves) for title, curves, _ in update_panels(rows)
    }
    # update i of n in step s sits at s - 1 + i / n; the gated update has no weight change
    change = panels["DWD: relative weight change per update"]["lm_head"]
    assert change == ([0.5, 1.0, 1 + 1 / 3, 1 + 2 / 3], [4e-3] * 4)
    z = panels["DGG: lm_head grad energy z-score"]
    assert z["z"] == ([1.0, 1 + 1 / 3, 1 + 2 / 3, 2.0], [0.3, -0.2, 0.1, 2.5])
    assert z[GATED] == ([2.0], [2.5])
    assert panels["grad norm per update"]["lm_head"][1] == [2.0, 2.5, 1.5, 1.6, 9.0]
    assert paths["plot"].is_file()


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


def test_a_resumed_run_keeps_the_history_up_to_its_checkpoint_and_logs_each_step_once(tmp_path: Path) -> None:
    """The interrupted run logged steps 3 and 4 after its step-2 checkpoint: the resumed run
    (resume_step=2) drops them (and what was logged with them) and logs its own; the file is
    rewritten whole, and a run that starts over starts an empty file."""
    cfg = TelemetryConfig(dir=str(tmp_path), progress=False, plot=False, gpu_stats=False)
    path = tmp_path / "metrics.jsonl"
    before = [
        {"step": 0, "eval/pass1_dense": 0.1},
        {"step": 1, "rollout/reward_mean": 0.1},
        {"step": 2, "rollout/reward_mean": 0.2},
        {"event": "stopped", "reason": "SIGUSR1", "step": 2},
        {"step": 3, "rollout/reward_mean": 0.3},
        {"event": "engine_failed", "url": "http://x"},
        {"step": 4, "rollout/reward_mean": 0.4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in before) + '{"step": 5, "rollou')
    updates = tmp_path / "updates.jsonl"  # the per-update history is kept the same way (issue 36)
    updates.write_text(
        "".join(
            json.dumps({"step": s, "update": u, "dwd/ratio": s}) + "\n" for s in (1, 2, 3) for u in (1, 2)
        )
    )
    logger = MetricsLogger(cfg, resume_step=2)
    logger.event("resumed", {"step": 2})
    for step in (3, 4):
        logger.log({"rollout/reward_mean": step / 100}, step=step)
        logger.log_updates([{"dwd/ratio": step * 10}], step=step)
    logger.close()
    assert [(r["step"], r["update"], r["dwd/ratio"]) for r in read_metrics(updates)] == [
        (1, 1, 1),
        (1, 2, 1),
        (2, 1, 2),
        (2, 2, 2),
        (3, 1, 30),
        (4, 1, 40),
    ]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r.get("step"), r.get("event"), r.get("rollout/reward_mean")) for r in rows] == [
        (0, None, None),
        (1, None, 0.1),
        (2, None, 0.2),
        (2, "stopped", None),
        (2, "resumed", None),
        (3, None, 0.03),
        (4, None, 0.04),
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "updates.jsonl"]  # no temp file
    MetricsLogger(cfg).close()
    assert path.read_text() == ""


def _served_samples(tmp_path: Path, kv):
    import torch

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    hf = make_tiny(TinyModelConfig(seed=5), tmp_path / f"tiny-{kv.method}")
    engine = EmbeddedEngine(hf, EngineConfig(device="cpu", page_size=8, kv_compression=kv))
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    requests = [GenerateRequest(input_ids=tuple(range(10, 10 + n)), sampling=params) for n in (5, 11, 19)]
    samples = engine.generate(requests)
    info = engine.model_info()
    per_token = info["page_bytes"] // info["page_size"]  # K+V of one position, all layers
    return samples, per_token, torch.zeros(len(samples))


def test_the_kv_saving_compares_whole_pages_with_whole_pages(tmp_path: Path) -> None:
    """Uncompressed, a request's peak KV is exactly the dense figure (1.0x, never "0.8x less");
    compressed below the generation length, it is less, in the same units."""
    from types import SimpleNamespace

    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.trainer.step_metrics import rollout_metrics

    for kv, saving in (
        (KVCompressionConfig(), "(1.0x less)"),
        (
            KVCompressionConfig(method="streamingllm", budget=16, interval=4, window=4, sink_tokens=4),
            "(2.0x less)",  # 3 of 6 pages: max(prompt + 1, budget) = 20 positions
        ),
    ):
        samples, per_token, rewards = _served_samples(tmp_path, kv)
        got = rollout_metrics(samples, SimpleNamespace(rewards_B=rewards), per_token)
        page = 8 * per_token
        cached = 19 + 30 - 1  # the longest prompt and its output but the last token
        assert got["rollout/dense_kv_bytes"] == -(-cached // 8) * page  # 6 whole pages
        assert saving in step_line(1, got), (kv.method, got)
