"""Asynchronous RL end to end, through the real loop: the staleness bound under a generation-bound
engine, and a run stopped by a signal with batches in flight, then resumed.

Staleness: no real path brings a token older than `max_staleness` (eta) to the trainer (docs/async.md,
"Admission bounds the staleness": a batch is admitted while every live engine holds the learner's
version, at most eta versions are published before it is trained, an engine that misses one leaves
the pool). So the loop-level check is the invariant itself where it is under most pressure: one rank
with the embedded engine, in flight at eta 2, generation several times slower than an update (48
tokens per sample, the batch's 4 groups one after another, against one optimizer step on its 8
sequences), so batches generate across syncs and updates land inside sequences (measured: in every
step from the 4th on, in 4 runs of 8 steps; the first 3 batches all start at step 1 and finish
together). Every trained token is within eta and counted in the histogram, the bound is reached,
nothing is masked. A loop admitting one batch early trains lag-3 tokens here.

Stop and resume: two learner ranks (TP=2) and one `sparserl serve` subprocess, shared by the cases.
SIGTERM in flight (batches generated two versions ahead, every sync lands while the server decodes:
the host pauses it in place, each rank posts its own fragment, the host continues it) and SIGUSR1
one-step-off (the sync waits for the batch in flight, so every sample keeps one version). The stop
is at a step boundary with a checkpoint, exit 0 (what was generating is aborted on the server); the
checkpoint records the data position of the batches TRAINED (those in flight are regenerated on
resume); the resumed run (same server, reset by its full sync) trains every remaining step once: no
batch twice, none skipped.
"""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest
from e2e_support import PY, REPO, make_assets, metrics, subprocess_env, write_config
from test_e2e_faults import _serve, _url, _wait_healthy
from test_preemption import _rank_process, _wait_step

from sparserl_mcore.parallel.launch import launch_local, torchrun_command

TRAIN = str(REPO / "launchers" / "train.py")
STEPS, PROMPTS = 6, 4
SLOW_TOKENS, SLOW_ETA, SLOW_STEPS = 48, 2, 8  # the generation-bound run


def _steps(root, name: str) -> list[dict]:
    return [r for r in metrics(root, name) if "rollout/reward_mean" in r]


@pytest.mark.timeout(300)
def test_generation_bound_in_flight_run_trains_no_token_older_than_max_staleness(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "slow",
        parallel={"tensor_model_parallel_size": 1},
        rollout={
            "group_size": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": SLOW_TOKENS, "ignore_eos": True},
        },
        eval={"dense": False, "compressed": False, "at_start": False},
        train={
            "steps": SLOW_STEPS,
            "prompts_per_step": 4,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "reuse_epochs": 1,
            "filter_zero_variance_groups": False,  # every step trains all 8 sequences
            "async": {"mode": "in_flight", "max_staleness": SLOW_ETA},
        },
        checkpoint={"dir": None, "every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)]
    run = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _steps(tmp_path, "slow")
    assert [r["step"] for r in rows] == list(range(1, SLOW_STEPS + 1))
    for r in rows:
        histogram = sum(r[f"staleness/tokens_lag{k}"] for k in range(SLOW_ETA + 1))
        assert r["staleness/lag_max"] <= SLOW_ETA and r["staleness/masked_tokens"] == 0, r
        assert histogram == r["train/sequences"] * SLOW_TOKENS, r  # every trained token has its lag
    # the bound is reached (a batch admitted one step early would show lag 3 here), and the run was
    # generation-bound: updates landed inside sequences, whose tokens then span versions
    assert sum(r[f"staleness/tokens_lag{SLOW_ETA}"] for r in rows) > 0
    assert sum(r["staleness/mixed_sequences"] for r in rows) > 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Tiny assets and one `sparserl serve` on them: (assets root, hf dir, url)."""
    root = tmp_path_factory.mktemp("async")
    hf = make_assets(root)
    server = _serve(hf, subprocess_env())
    try:
        url = _url(server)
        _wait_healthy(url, server)
        yield root, hf, url
    finally:
        server.kill()
        server.wait()


def _data_state(root, name: str, step: int) -> dict:
    record = root / name / "ckpt" / f"step_{step:08d}" / "run.json"
    return json.loads(record.read_text())["data"]


def _after(state: dict, batches: int) -> dict:
    """The sampler's position after `batches` batches of PROMPTS from the start of the run."""
    drawn = batches * PROMPTS
    return {**state, "epoch": drawn // state["n"], "offset": drawn % state["n"]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "sig, mode, eta",
    [(signal.SIGTERM, "in_flight", 2), (signal.SIGUSR1, "one_step", 1)],
    ids=["SIGTERM", "SIGUSR1"],
)
def test_stop_with_batches_in_flight_then_resume_trains_every_batch_exactly_once(served, sig, mode, eta):
    root, hf, url = served
    env, name = subprocess_env(), f"run-{mode}"
    cfg = write_config(
        root,
        hf,
        name,
        rollout={
            "engine": "remote",
            "urls": [url],
            "group_size": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True},
        },
        eval={"dense": False, "compressed": False, "at_start": False},
        train={"steps": STEPS, "prompts_per_step": PROMPTS, "async": {"mode": mode, "max_staleness": eta}},
        checkpoint={"every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    out, code = _stopped_run(root, name, cfg, env, sig)
    assert code == 0, out[-3000:]
    saved = _check_stop(root, name, sig)
    assert f"stopped by {sig.name}: steps 0 -> {saved} in " in out, out[-3000:]
    launch_local([TRAIN, "--config", str(cfg)], 2, env=env, timeout=300)
    rows = _check_resumed(root, name, saved, eta)
    if mode == "in_flight":  # every sync landed in flight through the bracket, timed by the server
        assert all(r["time/sync_pause_ms"] > 0 for r in rows if r["train/updates"] > 0)
    else:  # one-step-off: the sync waited for the batch in flight, so each batch has ONE version
        assert all(r["staleness/mixed_sequences"] == 0 for r in rows)
        assert all(r["staleness/lag_mean"] == r["staleness/lag_max"] for r in rows)
        assert sum(r["staleness/tokens_lag1"] for r in rows) > 0


def _stopped_run(root, name: str, cfg, env, sig: signal.Signals) -> tuple[str, int]:
    """The run, signalled on rank 0 once step 2 is logged: its output and exit code."""
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
        _wait_step(root, name, 2, proc)
        rank0.send_signal(sig)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    return out, proc.returncode


def _check_stop(root, name: str, sig: signal.Signals) -> int:
    """One stop at a step boundary; its checkpoint holds the position of the TRAINED batches only
    (the sampler had drawn up to eta more). Returns the step it stopped after."""
    stopped = [r for r in metrics(root, name) if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == sig.name, stopped
    saved = stopped[0]["step"]
    assert 2 <= saved < STEPS
    state = _data_state(root, name, saved)
    assert state == _after(state, saved)
    return saved


def _check_resumed(root, name: str, saved: int, eta: int) -> list[dict]:
    resumed = [r["step"] for r in metrics(root, name) if r.get("event") == "resumed"]
    assert resumed == [saved]
    rows = _steps(root, name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, across the stop
    assert rows[-1]["train/rollouts"] == STEPS * PROMPTS * 8
    assert all(r["staleness/lag_max"] <= eta and r["staleness/masked_tokens"] == 0 for r in rows)
    state = _data_state(root, name, STEPS)
    assert state == _after(state, STEPS)
    return rows
