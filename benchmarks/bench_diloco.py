"""DDP vs DiLoCo vs PULSELoCo: trainer-to-trainer bytes, gate density and evals, on two tasks.

    python -m benchmarks.bench_diloco [--tasks demo running_sum] [--seeds 0 1 2] [--hs 1 4 8]
        [--steps N] [--out runs/diloco]
    python -m benchmarks.bench_diloco --lr-sweep 1e-4 1e-5 1e-6 [--steps 10] [--out runs/diloco-lr]
    python -m benchmarks.bench_diloco --outer 1.0:0.0 [--seeds 0] [--hs 1 8] [--out runs/diloco-outer]
    python -m benchmarks.bench_diloco --report [any of the above]   # tables from OUT/results.json only
    python -m benchmarks.bench_diloco --scale [--full] [--lrs 1e-6 3e-6] [--hs 4 8 16]   # 0.5B shape

Every run is `sparserl train --nproc 2` of examples/demo.yaml as `sparserl demo --seed S` configures
it, from that seed's warm start, with DGG off (no update is gated) and evals at the start and the end
only. Arms:
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
included, as in megatron's gradient buffer). The columns "DiLoCo / this" and "DDP / this" divide
what DiLoCo and DDP send for the run's own outer and inner steps (its `dense_bytes`, and
4 B x N x 2 x its inner steps) by what the run sent: the arms do not make equal inner steps, since
an RL step whose zero-variance filtering keeps <= 80 of 128 sequences makes 1 optimizer update per
epoch instead of 2 (trainer/loop.py `_trim`). Also per run: gate density per outer step
(`diloco_outer_step` events), bytes per sent entry (the authors send 12), the rollouts' policy lag
behind the islands (rollouts come from agreed weights only), the final greedy evals (the run's
own, on its final agreed weights) and the train reward.
--lr-sweep runs only pulse-H8 on the demo task, seed 0, at each Adam learning rate given: the gate
density depends on how far an update moves a weight relative to its BF16 cell (bytes, not evals).
--outer runs only dense DiLoCo on the demo task at other outer SGD settings (lr:momentum, e.g.
1.0:0.0, plain averaging of the islands' weights), for --seeds and --hs.
Writes OUT/results.json (kept after every run; a rerun skips finished runs) and prints the tables;
--report runs nothing and prints them from OUT/results.json, naming the (task, seed, arm) missing.
--scale is the bytes-only mode at the scale of the claim (the Qwen2.5-0.5B shape with --full, RL
learning rates): `benchmarks.bench_pulse_scale`, which it runs with the arguments that follow.
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
    p.add_argument("--report", action="store_true", help="run nothing: the tables of OUT/results.json")
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


def _ratios(arm: str, row: dict, elements: float) -> tuple[float | None, float]:
    """(DiLoCo's bytes, DDP's bytes) over this run's bytes, at the run's own outer and inner steps."""
    sent = trainer_bytes(arm, row, elements)
    dense = row["dense_bytes"] / sent if arm.startswith("pulse") else None
    return dense, 4.0 * elements * 2 * row["inner_steps"] / sent


def _cell(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    text = fmt.format(statistics.fmean(values))
    return text + (f" ({fmt.format(min(values))}-{fmt.format(max(values))})" if len(values) > 1 else "")


def _eval_key(runs: list[dict]) -> str:
    return "eval/pass1_dense" if any("final_eval/pass1_dense" in r for r in runs) else "eval/pass1_compressed"


COLUMNS = (
    "arm", "seeds", "final greedy eval", "final eval, compressed KV", "reward last 5", "inner / outer steps",
    "trainer-to-trainer bytes", "DiLoCo / this", "DDP / this", "gate density per outer step",
    "bytes / sent entry", "rollout lag (updates)",
)  # fmt: skip


def _row(arm: str, seeds: list[str], runs: list[dict], key: str, elements: float) -> list[str]:
    from sparserl_mcore.telemetry.console import human_bytes

    mean = statistics.fmean
    ratios = [_ratios(arm, r, elements) for r in runs]
    density = [d for r in runs for d in r.get("density", [])]
    compressed = [r["final_eval/pass1_compressed"] for r in runs if key != "eval/pass1_compressed"]
    outer = f"{mean(r['outer_steps'] for r in runs):.0f}" if arm != "ddp" else "-"
    steps = f"{mean(r['inner_steps'] for r in runs):.0f} / {outer}"
    return [
        arm,
        ", ".join(seeds),
        _cell([r[f"final_{key}"] for r in runs]),
        _cell(compressed),
        _cell([r["reward_last5"] for r in runs]),
        steps,
        human_bytes(mean(trainer_bytes(arm, r, elements) for r in runs)),
        _cell([d for d, _ in ratios if d is not None], "{:.1f}x") if arm.startswith("pulse") else "-",
        _cell([d for _, d in ratios], "{:.1f}x"),
        _cell(density) if density else "-",
        _cell([r["bytes_per_entry"] for r in runs], "{:.2f}") if arm.startswith("pulse") else "-",
        _cell([r["policy_lag"] for r in runs], "{:.2f}") if "policy_lag" in runs[0] else "-",
    ]


def print_tables(results: dict, task: str, seeds: list[int], hs: list[int]) -> list[str]:
    """The task's table (markdown); returns the lines of goals missed or not measured."""
    got = results.get(task, {})
    have = {arm: [str(s) for s in seeds if arm in got.get(str(s), {})] for arm in arms(hs)}
    absent = {s: [arm for arm, found in have.items() if str(s) not in found] for s in seeds}
    if any(absent.values()):
        lost = [
            f"seed {s} " + (", ".join(a) if len(a) < len(have) else "(every arm)")
            for s, a in absent.items()
            if a
        ]
        print(f"\n{task}: not in the results: {'; '.join(lost)}")
    elements = [got[s][arm]["elements"] for arm, found in have.items() for s in found if arm != "ddp"]
    if not elements:
        return [f"{task}: no island run, nothing measured"]
    n = statistics.fmean(elements)
    print(f"\n{task}: mean (min-max) over the seeds listed; N = {n:,.0f} per island")
    print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
    per_arm = {arm: [got[s][arm] for s in found] for arm, found in have.items()}
    key = _eval_key(per_arm["ddp"])
    for arm, runs in per_arm.items():
        if runs:
            print("| " + " | ".join(_row(arm, have[arm], runs, key, n)) + " |")
    top = f"pulse-H{max(hs)}"
    return _goals(task, top, per_arm, key, n) if per_arm[top] else [f"{task} {top}: not run"]


def _goals(task: str, arm: str, per_arm: dict[str, list[dict]], key: str, elements: float) -> list[str]:
    """The issue's goals at the largest H: >= 17x fewer bytes than DiLoCo, >= 100x fewer than DDP
    (mean ratio over the seeds, at equal steps), the mean final eval inside DiLoCo's seed spread."""
    runs, missed = per_arm[arm], []
    ratios = [_ratios(arm, r, elements) for r in runs]
    dense = statistics.fmean(d for d, _ in ratios if d is not None)
    ddp = statistics.fmean(d for _, d in ratios)
    if dense < 17:
        missed.append(f"{task} {arm}: {dense:.1f}x fewer bytes than DiLoCo (goal >= 17x)")
    if ddp < 100:
        missed.append(f"{task} {arm}: {ddp:.1f}x fewer bytes than DDP (goal >= 100x)")
    spread = [r[f"final_{key}"] for r in per_arm[arm.replace("pulse", "diloco")]]
    mean = statistics.fmean(r[f"final_{key}"] for r in runs)
    if not spread:
        missed.append(f"{task} {arm}: no {arm.replace('pulse', 'diloco')} run, eval goal not measured")
    elif not min(spread) <= mean <= max(spread):
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
    print(
        "\n| Adam lr | inner / outer steps | gate density per outer step | DiLoCo / this | DDP / this "
        "| bytes / sent entry | greedy eval, dense KV: start -> final | compressed KV: final "
        "| reward first 5 -> last 5 |"
    )
    print("|---" * 9 + "|")
    for lr in lrs:
        row = results.get("demo", {}).get("0", {}).get(f"pulse-H8-lr{lr:g}")
        if row is None:
            print(f"| {lr:g} | not in the results |" + " |" * 7)
            continue
        dense, ddp = _ratios("pulse", row, row["elements"])
        print(
            f"| {lr:g} | {row['inner_steps']:.0f} / {row['outer_steps']} | {_cell(row['density'], '{:.2f}')} "
            f"| {dense:.1f}x | {ddp:.1f}x | {row['bytes_per_entry']:.2f} "
            f"| {row['start_eval/pass1_dense']:.3f} -> {row['final_eval/pass1_dense']:.3f} "
            f"| {row['final_eval/pass1_compressed']:.3f} "
            f"| {row['reward_first5']:.3f} -> {row['reward_last5']:.3f} |"
        )


def main(argv: list[str]) -> int:
    from sparserl_mcore.telemetry.console import quiet_library_output

    if argv[:1] == ["--scale"]:
        from benchmarks.bench_pulse_scale import main as scale

        return scale(argv[1:])
    a = _args(argv)
    quiet_library_output()
    out = Path(a.out).resolve()
    results_path = out / "results.json"
    results: dict = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for task, seed, arm, overrides, steps in [] if a.report else _plan(a):
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
        print("\n".join(["goals missed or not measured:", *missed]) if missed else "every goal met")
    print(f"results: {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
