"""A run that cannot train fails and says why (issue 36), through `sparserl train` on one CPU rank.

- a NaN reward stops the run at its first sample, naming the reward and the sample (exit 4);
- a reward that hangs is abandoned past reward.timeout_s, naming the reward and the sample (exit 4),
  and its process is gone;
- steps that train nothing (no token generated; every reward equal) stop the run after
  train.max_empty_steps of them, naming the cause (exit 5), each step's line saying it trained 0;
- with reward.skip_nonfinite and data.skip_bad_rows the same kind of faults are skipped, counted
  and logged, and the run trains and reports how many updates it applied (asynchronously: each
  step line shows the mode and the lag, and the plot has a staleness panel).
Each run is one process (TP 1, no torchrun) and a few steps of the tiny model: what matters is the
outcome, not the learning.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import psutil
import pytest
from e2e_support import PY, make_assets, metrics, subprocess_env, write_config

from sparserl_mcore.telemetry import read_metrics
from sparserl_mcore.telemetry.plot import drawable_panels

ONE_RANK = {"tensor_model_parallel_size": 1}
NO_SAVE = {"dir": None, "every": 0, "save_hf": None}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrainable")
    return root, make_assets(root)


def _run(root, hf, name: str, *overrides: str, **sections: dict) -> subprocess.CompletedProcess:
    sections = {"parallel": ONE_RANK, "checkpoint": NO_SAVE, "train": {"steps": 3}, **sections}
    cfg = write_config(root, hf, name, **sections)
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)


def _last_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sparserl train: ")]
    assert lines and "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def test_a_nan_reward_stops_the_run_at_once_naming_the_reward_and_the_sample(assets):
    root, hf = assets
    proc = _run(root, hf, "nan", "reward.name=e2e_support:nan_reward")
    assert proc.returncode == 4, proc.stderr
    assert re.match(
        r"sparserl train: reward e2e_support:nan_reward returned nan for sample step1-p0-g0 "
        r"\(completion .*\): a reward must be a finite float32; .* reward.skip_nonfinite=true",
        _last_error(proc),
    )
    assert (
        "stopped (exit code 4): steps 0 -> 0" in proc.stdout and "0 optimizer updates applied" in proc.stdout
    )
    assert not [r for r in metrics(root, "nan") if "rollout/reward_mean" in r]  # no step was trained


def test_a_hung_reward_is_abandoned_past_its_timeout(assets):
    root, hf = assets
    started = time.monotonic()
    proc = _run(root, hf, "hung", "reward.name=e2e_support:hung_reward", "reward.timeout_s=2")
    assert proc.returncode == 4, proc.stderr
    assert _last_error(proc) == (
        "sparserl train: reward e2e_support:hung_reward did not return within reward.timeout_s=2 s for "
        "sample step1-p0-g0; the call was abandoned (its process killed)"
    )
    assert time.monotonic() - started < 200  # the hour the reward sleeps is not waited for
    workers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "sparserl_mcore.rewards.worker" in (p.info["cmdline"] or [])
    ]
    assert not [p for p in workers if p.ppid() == 1], "a reward process outlived its run"


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        (["rollout.sampling.max_new_tokens=0"], "no tokens generated"),
        (["reward.name=e2e_support:zero_reward"], "all rewards equal to 0: no reward variance"),
    ],
    ids=["no_tokens", "equal_rewards"],
)
def test_steps_that_train_nothing_stop_the_run_naming_the_cause(assets, overrides, cause):
    root, hf = assets
    name = f"empty_{len(cause)}"
    proc = _run(root, hf, name, *overrides, "train.max_empty_steps=2", "train.steps=5")
    assert proc.returncode == 5, proc.stderr
    assert _last_error(proc).startswith(
        f"sparserl train: stopped after 2 consecutive steps that trained nothing: {cause}"
    ), proc.stderr
    assert re.findall(r"^step (\d+) .*trained 0 seq", proc.stdout, re.M) == ["1", "2"], proc.stdout
    assert (
        "stopped (exit code 5): steps 0 -> 2" in proc.stdout and "0 optimizer updates applied" in proc.stdout
    )


def test_skipped_rewards_and_rows_are_counted_and_the_run_trains(assets):
    """Odd rows answer "nan" (the reward returns NaN there) and line 5 has an empty prompt. The run
    is asynchronous (one_step): its step lines show the mode and the lag, its plot a staleness panel."""
    root, hf = assets
    rows = [{"prompt": f"say {i}:", "answer": "nan" if i % 2 else "a"} for i in range(32)]
    rows[4]["prompt"] = ""
    (root / "skip.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _run(
        root,
        hf,
        "skip",
        "reward.name=e2e_support:nan_when_asked",
        "reward.skip_nonfinite=true",
        "data.skip_bad_rows=true",
        "train.steps=2",
        "train.async.mode=one_step",
        data={"train_path": str(root / "skip.jsonl"), "eval_fraction": 0.0},
        telemetry={"dir": str(root / "skip" / "metrics"), "plot": True, "progress": True},
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"data.skip_bad_rows: skipping 1 training rows \(first: .*skip.jsonl:5: the prompt is empty",
        proc.stdout,
    )
    records = metrics(root, "skip")
    steps = [r for r in records if "train/sequences" in r]
    skipped = [e for e in records if e.get("event") == "nonfinite_reward_skipped"]
    assert (
        sum(r.get("reward/nonfinite_skipped", 0) for r in steps)
        == sum(len(e["samples"]) for e in skipped)
        > 0
    )
    assert all(re.fullmatch(r"step\d-p\d-g\d", rid) for e in skipped for rid in e["samples"])
    updates = sum(r["train/updates"] for r in steps if "train/updates" in r)
    assert updates > 0 and f", {updates:.0f} optimizer updates applied" in proc.stdout, proc.stdout
    assert re.findall(r"^step (\d) .*trained (\d+) seq  one_step lag ([\d.]+) \(max", proc.stdout, re.M) == [
        (str(r["step"]), f"{r['train/sequences']:.0f}", f"{r['staleness/lag_mean']:.2f}") for r in steps
    ]
    assert [r["staleness/lag_max"] for r in steps] == [0, 1]  # batch 2 was sampled a version back
    plotted = {
        title for title, _, _ in drawable_panels(read_metrics(root / "skip" / "metrics" / "metrics.jsonl"))
    }
    assert (
        "staleness: lag of trained tokens" in plotted
        and (root / "skip" / "metrics" / "summary.png").is_file()
    )
