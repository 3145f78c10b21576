"""Asynchronous RL, stopped and resumed: SIGTERM mid-run while batches are generated two versions
ahead stops at a step boundary with a checkpoint and exits 0 (what was generating is aborted), the
checkpoint records the data position of the batches TRAINED (those in flight are regenerated on
resume), and the resumed run trains every remaining step once: no batch twice, none skipped."""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config
from test_preemption import _rank_process, _wait_step

from sparserl_mcore.parallel.launch import launch_local, torchrun_command

TRAIN = str(REPO / "launchers" / "train.py")
STEPS, PROMPTS, AHEAD = 6, 4, 2


def _data_state(tmp_path, step: int) -> dict:
    record = tmp_path / "run" / "ckpt" / f"step_{step:08d}" / "run.json"
    return json.loads(record.read_text())["data"]


def _after(state: dict, batches: int) -> dict:
    """The sampler's position after `batches` batches of PROMPTS from the start of the run."""
    drawn = batches * PROMPTS
    return {**state, "epoch": drawn // state["n"], "offset": drawn % state["n"]}


@pytest.mark.timeout(420)
def test_sigterm_with_batches_in_flight_then_resume_trains_every_batch_exactly_once(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    cfg = write_config(
        tmp_path,
        hf,
        "run",
        parallel={"tensor_model_parallel_size": 1},
        rollout={
            "group_size": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True},
            "kv": {"method": "snapkv", "budget": 8, "interval": 2, "window": 2, "kernel_size": 3},
        },
        train={
            "steps": STEPS,
            "prompts_per_step": PROMPTS,
            "async": {"mode": "in_flight", "max_staleness": AHEAD},
        },
        checkpoint={"every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(cfg)], 1),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        rank0 = _rank_process(proc, 0)
        _wait_step(tmp_path, "run", 2, proc)
        rank0.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    stopped = [r for r in metrics(tmp_path, "run") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "SIGTERM", stopped
    saved = stopped[0]["step"]
    assert 2 <= saved < STEPS
    # the sampler had drawn up to AHEAD more batches; the checkpoint holds only the trained ones
    state = _data_state(tmp_path, saved)
    assert state == _after(state, saved)

    launch_local([TRAIN, "--config", str(cfg)], 1, env=env, timeout=300)
    steps = [r["step"] for r in metrics(tmp_path, "run") if "rollout/reward_mean" in r]
    assert steps == list(range(1, STEPS + 1))  # every step once, across the stop
    rows = [r for r in metrics(tmp_path, "run") if "rollout/reward_mean" in r]
    assert rows[-1]["train/rollouts"] == STEPS * PROMPTS * 8
    assert all(r["staleness/lag_max"] <= AHEAD and r["staleness/masked_tokens"] == 0 for r in rows)
    assert _data_state(tmp_path, STEPS) == _after(state, STEPS)
