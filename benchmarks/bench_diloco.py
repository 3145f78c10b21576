"""DDP vs DiLoCo vs PULSELoCo: trainer-to-trainer bytes, gate density and evals, on two tasks.

    python -m benchmarks.bench_diloco [--tasks demo running_sum] [--seeds 0 1 2] [--hs 1 4 8]
        [--steps N] [--out runs/diloco]
    python -m benchmarks.bench_diloco --lr-sweep 1e-4 1e-5 1e-6 [--steps 10] [--out runs/diloco-lr]
    python -m benchmarks.bench_diloco --outer 1.0:0.0 [--seeds 0] [--hs 1 8] [--out runs/diloco-outer]

Every run is `sparserl train --nproc 2` of examples/demo.yaml as `sparserl demo --seed S` configures
it, from that seed's warm start, with DGG off (so every run makes exactly the same number of inner
optimizer steps: 8 per RL step) and evals at the start and the end only. Arms:
  ddp        one island, TP=1 x DP=2: megatron's gradient all-reduce every optimizer step
  diloco-H   2 islands of one rank (parallel.islands=2), diloco.mode=dense, inner_steps H
  pulse-H    2 islands, diloco.mode=pulse (PULSELoCo), inner_steps H
Both island arms use the outer Nesterov SGD defaults (lr 0.7, momentum 0.9). Tasks:
  demo         the demo's digit chains (trainer/tasks.py DEMO_TASK), StreamingLLM-16 rollouts
  running_sum  labelled running sums of 3-5 digits (RunningSumTask), dense rollouts (compression
               evicts the prompt digits every step copies), a 300-step warm start, binary reward
RL steps per run: the demo's 40 and 20 for running_sum (its steps cost about as much), or --steps.
Trainer-to-trainer bytes over the run (what the islands, or the DDP replicas, contribute to the
links between them; both replicas / islands summed):
  DDP       4 B (FP32 gradient, megatron's grad_reduce_in_fp32) x N x 2 replicas x inner steps
  DiLoCo    the run's `diloco/total_dense_bytes`: 4 B x N x 2 islands x outer steps
  PULSELoCo the run's `diloco/total_payload_bytes`: the coded payloads, as sent
N = elements each island exchanges (the outer step's owned FP32 ranges; vocabulary padding
included, as in megatron's gradient buffer). Also per run: gate density per outer step
(`diloco_outer_step` events), bytes per sent entry (the authors send 12), the rollouts' policy lag
behind the islands (rollouts come from agreed weights only), the final greedy evals (the run's
own, on its final agreed weights) and the train reward.
--lr-sweep runs only pulse-H8 on the demo task, seed 0, at each Adam learning rate given: the gate
density depends on how far an update moves a weight relative to its BF16 cell (bytes, not evals).
--outer runs only dense DiLoCo on the demo task at other outer SGD settings (lr:momentum, e.g.
1.0:0.0, plain averaging of the islands' weights), for --seeds and --hs.
Writes OUT/results.json (kept after every run; a rerun skips finished runs) and prints the tables.
Results: docs/benchmarks.md, "DiLoCo islands".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import yaml

RUN = [
    "checkpoint.every=0",
    "checkpoint.resume=false",
    "telemetry.plot=false",
    "telemetry.progress=false",
    "dgg.enabled=false",
    "eval.every=0",
]
TASKS = ("demo", "running_sum")
STEPS = {"demo": None, "running_sum": 20}  # None: examples/demo.yaml's train.steps


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_diloco", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--hs", type=int, nargs="+", default=[1, 4, 8], help="inner steps H of the island arms")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: examples/demo.yaml)")
    p.add_argument(
        "--lr-sweep", type=float, nargs="*", default=[], help="only pulse-H8 runs at these Adam lrs"
    )
    p.add_argument(
        "--outer", nargs="*", default=[], metavar="LR:M", help="only DiLoCo runs at these outer lr:m"
    )
    p.add_argument("--out", default="runs/diloco", help="work directory (warm starts, runs, results)")
    return p.parse_args(argv)


def arms(hs: list[int]) -> dict[str, list[str]]:
    """arm -> run-config overrides (on top of the demo's configuration at TP=1)."""
    out = {"ddp": []}
    for h in hs:
        for mode, name in (("dense", "diloco"), ("pulse", "pulse")):
            out[f"{name}-H{h}"] = ["parallel.islands=2", f"diloco.mode={mode}", f"diloco.inner_steps={h}"]
    return out


def prepare(task: str, seed_dir: Path, seed: int) -> list[str]:
    """The task's warm start for `seed` under seed_dir; the overrides that make the demo run it."""
    from sparserl_mcore.trainer.tasks import RunningSumTask
    from sparserl_mcore.trainer.warmstart import WarmStartConfig, prepare_policy

    if task == "demo":
        prepare_policy(seed_dir, n_eval=64, seed=seed)
        return []
    cfg = WarmStartConfig(steps=300, batch_size=32, lr=3e-3, warmup_steps=20)
    prepare_policy(seed_dir, task=RunningSumTask(min_length=3, max_length=5), cfg=cfg, n_eval=64, seed=seed)
    # 7 tokens per digit + the answer line (RunningSumTask); dense KV: evicting the prompt kills the task
    return [
        "reward.name=running_sum",
        "rollout.kv.method=none",
        "rollout.sampling.max_new_tokens=38",
        "eval.dense=false",
    ]


def run_arm(out: Path, task: str, seed: int, arm: str, overrides: list[str], steps: int | None) -> Path:
    """One training run; returns its run directory (metrics.jsonl inside)."""
    from sparserl_mcore.demo import demo_config
    from sparserl_mcore.trainer.cli import main as train

    seed_dir, run_dir = out / task / f"seed{seed}", out / task / f"seed{seed}" / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    paths = [
        f"telemetry.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"checkpoint.save_hf={run_dir / 'hf'}",
    ]
    config = demo_config(
        seed_dir, steps, 1, [*prepare(task, seed_dir, seed), *overrides, *RUN, *paths], seed=seed
    )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if train(str(run_dir / "config.yaml"), [], nproc=2) != 0:
        raise RuntimeError(f"{task} seed {seed} {arm} failed: see {run_dir / 'logs'}")
    return run_dir


def summarize(metrics: Path) -> dict:
    """One run's numbers from its metrics.jsonl (step records and `diloco_outer_step` events)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("event") is None and r.get("rollout/reward_mean") is not None]
    outer = [r for r in records if r.get("event") == "diloco_outer_step"]
    evals = [r for r in records if "eval/pass1_compressed" in r or "eval/pass1_dense" in r]
    last = steps[-1]
    inner = sum(r.get("train/updates", 0.0) for r in steps)
    row = {
        "inner_steps": inner,
        "reward_first5": statistics.fmean(r["rollout/reward_mean"] for r in steps[:5]),
        "reward_last5": statistics.fmean(r["rollout/reward_mean"] for r in steps[-5:]),
        "reward_mean": statistics.fmean(r["rollout/reward_mean"] for r in steps),
        "mismatch_kl": statistics.fmean(r.get("correction/mismatch_kl", 0.0) for r in steps),
        "step_s": statistics.fmean(r["time/step_s"] for r in steps),
    }
    for key in ("eval/pass1_dense", "eval/pass1_compressed"):
        found = [r[key] for r in evals if key in r]
        if found:
            row[f"start_{key}"], row[f"final_{key}"] = found[0], found[-1]
    if outer:
        row |= {
            "outer_steps": len(outer),
            "density": [r["diloco/density"] for r in outer],
            "payload_bytes": last["diloco/total_payload_bytes"],
            "dense_bytes": last["diloco/total_dense_bytes"],
            "elements": outer[0]["diloco/dense_bytes"] / 4 / 2,  # per island
            "bytes_per_entry": last["diloco/total_payload_bytes"] / max(last["diloco/total_sent"], 1.0),
            "policy_lag": statistics.fmean(r.get("rollout/policy_lag_updates", 0.0) for r in steps),
        }
    return row


def trainer_bytes(arm: str, row: dict, elements: float) -> float:
    """Trainer-to-trainer bytes over the run (see the module docstring)."""
    if arm == "ddp":
        return 4.0 * elements * 2 * row["inner_steps"]
    return row["dense_bytes"] if arm.startswith("diloco") else row["payload_bytes"]


def _cell(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    text = fmt.format(statistics.fmean(values))
    return text + (f" ({fmt.format(min(values))}-{fmt.format(max(values))})" if len(values) > 1 else "")


def _eval_key(runs: list[dict]) -> str:
    return "eval/pass1_dense" if any("final_eval/pass1_dense" in r for r in runs) else "eval/pass1_compressed"


COLUMNS = (
    "arm", "final greedy eval", "final eval, compressed KV", "reward last 5", "inner / outer steps",
    "trainer-to-trainer bytes", "vs DiLoCo", "vs DDP", "gate density per outer step",
    "bytes / sent entry", "rollout lag (updates)",
)  # fmt: skip


def _row(arm: str, runs: list[dict], key: str, sent: float, dense: float | None, ddp: float) -> list[str]:
    from sparserl_mcore.telemetry.console import human_bytes

    mean = statistics.fmean
    density = [d for r in runs for d in r.get("density", [])]
    compressed = [r["final_eval/pass1_compressed"] for r in runs if key != "eval/pass1_compressed"]
    steps = f"{mean(r['inner_steps'] for r in runs):.0f} / {mean(r.get('outer_steps', 0) for r in runs):.0f}"
    return [
        arm,
        _cell([r[f"final_{key}"] for r in runs]),
        _cell(compressed),
        _cell([r["reward_last5"] for r in runs]),
        steps,
        human_bytes(sent),
        f"{dense / sent:.1f}x" if dense else "-",
        f"{ddp / sent:.1f}x",
        _cell(density) if density else "-",
        _cell([r["bytes_per_entry"] for r in runs], "{:.2f}") if arm.startswith("pulse") else "-",
        _cell([r["policy_lag"] for r in runs], "{:.2f}") if "policy_lag" in runs[0] else "-",
    ]


def print_tables(results: dict, task: str, seeds: list[int], hs: list[int]) -> list[str]:
    """The task's table (markdown); returns the lines of goals missed."""
    got = results[task]
    per_arm = {arm: [got[str(s)][arm] for s in seeds if arm in got.get(str(s), {})] for arm in arms(hs)}
    elements = statistics.fmean(r["elements"] for runs in per_arm.values() for r in runs if "elements" in r)
    sent = {
        arm: statistics.fmean(trainer_bytes(arm, r, elements) for r in runs)
        for arm, runs in per_arm.items()
        if runs
    }
    print(f"\n{task}: seeds {', '.join(map(str, seeds))}; mean (min-max); N = {elements:,.0f} per island")
    print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
    key, missed = _eval_key(per_arm["ddp"]), []
    for arm, runs in per_arm.items():
        if not runs:
            continue
        dense = sent.get(arm.replace("pulse", "diloco")) if arm != "ddp" else None
        print("| " + " | ".join(_row(arm, runs, key, sent[arm], dense, sent["ddp"])) + " |")
        if arm == f"pulse-H{max(hs)}":
            missed += _goals(task, arm, runs, per_arm, dense, sent["ddp"], sent[arm], key)
    return missed


def _goals(task, arm, runs, per_arm, dense, ddp_bytes, sent, key) -> list[str]:
    """The issue's goals at the largest H: >= 17x fewer bytes than DiLoCo, >= 100x fewer than DDP,
    the mean final eval inside DiLoCo's seed spread."""
    missed = []
    if dense and dense / sent < 17:
        missed.append(f"{task} {arm}: {dense / sent:.1f}x fewer bytes than DiLoCo (goal >= 17x)")
    if ddp_bytes / sent < 100:
        missed.append(f"{task} {arm}: {ddp_bytes / sent:.1f}x fewer bytes than DDP (goal >= 100x)")
    spread = [r[f"final_{key}"] for r in per_arm[arm.replace("pulse", "diloco")]]
    mean = statistics.fmean(r[f"final_{key}"] for r in runs)
    if spread and not min(spread) <= mean <= max(spread):
        low, high = min(spread), max(spread)
        missed.append(
            f"{task} {arm}: mean final eval {mean:.3f} outside DiLoCo's seed spread {low:.3f}-{high:.3f}"
        )
    return missed


def _plan(a: argparse.Namespace) -> list[tuple[str, int, str, list[str], int | None]]:
    """(task, seed, arm, overrides, steps) of every run asked for."""
    if a.lr_sweep:
        pulse = arms([8])["pulse-H8"]
        return [
            ("demo", 0, f"pulse-H8-lr{lr:g}", [*pulse, f"optimizer.lr={lr}"], a.steps) for lr in a.lr_sweep
        ]
    if a.outer:
        return [
            ("demo", seed, f"{arm}-outer-lr{lr:g}-m{m:g}", [*overrides, *_outer(lr, m)], a.steps)
            for lr, m in (_outer_spec(spec) for spec in a.outer)
            for seed in a.seeds
            for arm, overrides in arms(a.hs).items()
            if arm.startswith("diloco")
        ]
    return [
        (task, seed, arm, overrides, a.steps or STEPS[task])
        for task in a.tasks
        for seed in a.seeds
        for arm, overrides in arms(a.hs).items()
    ]


def _outer_spec(spec: str) -> tuple[float, float]:
    lr, _, momentum = spec.partition(":")
    return float(lr), float(momentum or 0)


def _outer(lr: float, momentum: float) -> list[str]:
    return [f"diloco.outer_lr={lr}", f"diloco.outer_momentum={momentum}"]


def print_outer(results: dict, a: argparse.Namespace) -> None:
    print("\n| arm | final greedy eval, dense KV | compressed KV | reward last 5 | inner steps |")
    print("|---|---|---|---|---|")
    for arm in sorted({arm for _, _, arm, _, _ in _plan(a)}):
        runs = [results["demo"][str(s)][arm] for s in a.seeds if arm in results["demo"].get(str(s), {})]
        evals = [_cell([r[f"final_eval/pass1_{k}"] for r in runs]) for k in ("dense", "compressed")]
        steps = statistics.fmean(r["inner_steps"] for r in runs)
        print(
            f"| {arm} | {evals[0]} | {evals[1]} | {_cell([r['reward_last5'] for r in runs])} | {steps:.0f} |"
        )


def print_lr_sweep(results: dict, lrs: list[float]) -> None:
    print("\n| Adam lr | gate density (mean over outer steps) | vs DiLoCo bytes | bytes / sent entry |")
    print("|---|---|---|---|")
    for lr in lrs:
        row = results["demo"]["0"][f"pulse-H8-lr{lr:g}"]
        ratio = row["dense_bytes"] / row["payload_bytes"]
        print(
            f"| {lr:g} | {statistics.fmean(row['density']):.4f} | {ratio:.1f}x "
            f"| {row['bytes_per_entry']:.2f} |"
        )


def main(argv: list[str]) -> int:
    from sparserl_mcore.telemetry.console import quiet_library_output

    a = _args(argv)
    quiet_library_output()
    out = Path(a.out).resolve()
    results_path = out / "results.json"
    results: dict = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for task, seed, arm, overrides, steps in _plan(a):
        if arm in results.get(task, {}).get(str(seed), {}):
            continue
        print(f"=== {task}, seed {seed}, {arm}", flush=True)
        run_dir = run_arm(out, task, seed, arm, overrides, steps)
        results.setdefault(task, {}).setdefault(str(seed), {})[arm] = summarize(run_dir / "metrics.jsonl")
        results_path.write_text(json.dumps(results, indent=1))
    if a.lr_sweep:
        print_lr_sweep(results, a.lr_sweep)
    elif a.outer:
        print_outer(results, a)
    else:
        missed = [m for task in a.tasks for m in print_tables(results, task, a.seeds, a.hs)]
        print("\n".join(["goals missed:", *missed]) if missed else "every goal met")
    print(f"results: {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
