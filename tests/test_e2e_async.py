"""Asynchronous RL in flight against a real `sparserl serve`, stopped and resumed.

Two learner ranks (TP=2) and one server subprocess: every sync lands while the server decodes the
next batches (the host pauses it in place, each rank posts its own fragment, the host continues it).
SIGTERM mid-run, with batches generated two versions ahead, stops at a step boundary with a
checkpoint and exits 0 (what was generating is aborted on the server); the checkpoint records the
data position of the batches TRAINED (those in flight are regenerated on resume); the resumed run
(same long-lived server, reset by its full sync) trains every remaining step once: no batch twice,
none skipped.
"""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config
from test_e2e_faults import _serve, _url, _wait_healthy
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


@pytest.mark.timeout(600)
def test_sigterm_with_batches_in_flight_then_resume_trains_every_batch_exactly_once(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    server = _serve(hf, env)
    try:
        url = _url(server)
        _wait_healthy(url, server)
        cfg = write_config(
            tmp_path,
            hf,
            "run",
            rollout={
                "engine": "remote",
                "urls": [url],
                "group_size": 8,
                "sampling": {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True},
            },
            eval={"dense": False, "compressed": False, "at_start": False},
            train={
                "steps": STEPS,
                "prompts_per_step": PROMPTS,
                "async": {"mode": "in_flight", "max_staleness": AHEAD},
            },
            checkpoint={"every": 0, "save_hf": None},
            telemetry={"plot": False, "progress": False},
        )
        out, code = _stopped_run(tmp_path, cfg, env)
        assert code == 0, out[-3000:]
        saved = _check_stop(tmp_path)
        launch_local([TRAIN, "--config", str(cfg)], 2, env=env, timeout=300)
    finally:
        server.kill()
        server.wait()
    _check_resumed(tmp_path, saved)


def _stopped_run(tmp_path, cfg, env) -> tuple[str, int]:
    """The run, SIGTERMed on rank 0 once step 2 is logged: its output and exit code."""
    proc = subprocess.Popen(
        torchrun_command([TRAIN, "--config", str(cfg)], 2),
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
    return out, proc.returncode


def _check_stop(tmp_path) -> int:
    """One stop at a step boundary; its checkpoint holds the position of the TRAINED batches only
    (the sampler had drawn up to AHEAD more). Returns the step it stopped after."""
    stopped = [r for r in metrics(tmp_path, "run") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "SIGTERM", stopped
    saved = stopped[0]["step"]
    assert 2 <= saved < STEPS
    state = _data_state(tmp_path, saved)
    assert state == _after(state, saved)
    return saved


def _check_resumed(tmp_path, saved: int) -> None:
    resumed = [r["step"] for r in metrics(tmp_path, "run") if r.get("event") == "resumed"]
    assert resumed == [saved]
    rows = [r for r in metrics(tmp_path, "run") if "rollout/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, across the stop
    assert rows[-1]["train/rollouts"] == STEPS * PROMPTS * 8
    assert all(r["staleness/lag_max"] <= AHEAD and r["staleness/masked_tokens"] == 0 for r in rows)
    # every sync landed in flight through the bracket, and the server timed how long it stood still
    assert all(r["time/sync_pause_ms"] > 0 for r in rows if r["train/updates"] > 0)
    state = _data_state(tmp_path, STEPS)
    assert state == _after(state, STEPS)
