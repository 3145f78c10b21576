"""The methods study: what KV-compressed rollouts, Sparse-RL, batch reuse and DGG each buy, on the demo task.

    python -m benchmarks bench_methods                       # 5 arms x seeds 0 1 2, the demo's steps
    python -m benchmarks.bench_methods [--seeds 0 1 2] [--arms a b c d e] [--steps N] [--out runs/methods]

Every run is `sparserl train --nproc 2` of examples/demo.yaml as `sparserl demo --seed S` configures
it (demo.demo_config), from that seed's warm start (trainer.warmstart.prepare_policy: the same data,
init and warm start for every arm of a seed), with the same steps and rollouts per step (the same
rollout budget). The arms (issue 14):
  a  dense rollouts, no correction, single-use GRPO (K=1)
  b  compressed rollouts (the demo's KV policy and budget), no correction, K=1
  c  compressed + Sparse-RL correction, K=1
  d  compressed + Sparse-RL, K=4 batch reuse, no DGG
  e  compressed + Sparse-RL, K=4, DGG (the demo's configuration)
Per arm, mean and min-max over seeds:
- final greedy eval, dense KV and compressed KV: the run's final HF export decoded by the embedded
  engine on every held-out prompt, without and with the demo's KV compression (the same for every
  arm, also arm a, whose trainer never decodes under compression);
- reward per rollout generated: the mean train reward over every rollout the run sampled (higher:
  the policy got better sooner), and the rollouts until the 5-step mean reward first reached
  --target (the DGG paper's "fewer rollouts for the same reward");
- peak KV bytes per request, sparse weight-sync bytes per step (with the dense BF16 bytes), wall
  seconds per step (the box may be shared: compare within one run of this script only).
Writes OUT/results.json (every run's numbers) and OUT/methods.png (reward and eval curves per arm),
prints a markdown table. Results: docs/benchmarks.md, "Methods".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from functools import partial
from pathlib import Path

import yaml


def _arm(label: str, kv: str, correction: str, reuse: int, dgg: bool) -> tuple[str, list[str]]:
    return label, [
        *([f"rollout.kv.method={kv}"] if kv else []),
        f"loss.correction.mode={correction}",
        f"train.reuse_epochs={reuse}",
        f"dgg.enabled={str(dgg).lower()}",
    ]


# arm -> (label, run-config overrides on top of the demo's configuration; kv "" keeps the demo's)
ARMS: dict[str, tuple[str, list[str]]] = {
    "a": _arm("dense rollouts, K=1", "none", "off", 1, False),
    "b": _arm("compressed, no correction, K=1", "", "off", 1, False),
    "c": _arm("compressed + Sparse-RL, K=1", "", "sparse_rl", 1, False),
    "d": _arm("compressed + Sparse-RL, K=4", "", "sparse_rl", 4, False),
    "e": _arm("compressed + Sparse-RL, K=4 + DGG", "", "sparse_rl", 4, True),
}
EVALS = ("eval/pass1_dense", "eval/pass1_compressed")  # the run's own, through its synced engines
RUN = ["checkpoint.every=0", "checkpoint.resume=false", "telemetry.plot=false", "telemetry.progress=false"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_methods", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: examples/demo.yaml)")
    p.add_argument("--target", type=float, default=0.2, help="5-step mean reward for 'rollouts to target'")
    p.add_argument("--out", default="runs/methods", help="work directory (warm starts, runs, results)")
    return p.parse_args(argv)


def run_arm(out: Path, seed: int, arm: str, steps: int | None) -> Path:
    """One training run of `arm` from seed `seed`'s warm start; returns its run directory."""
    from sparserl_mcore.demo import demo_config
    from sparserl_mcore.trainer.cli import main as train

    seed_dir, run_dir = out / f"seed{seed}", out / f"seed{seed}" / arm
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume, no stale metrics
    run_dir.mkdir(parents=True)
    paths = [
        f"telemetry.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"checkpoint.save_hf={run_dir / 'hf'}",
    ]
    overrides = [*ARMS[arm][1], *RUN, *paths]
    if arm == "a":
        overrides.append("eval.compressed=false")  # its engines are dense: the final eval covers it
    config = demo_config(seed_dir, steps, 2, overrides, seed=seed)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if train(str(run_dir / "config.yaml"), [], nproc=2) != 0:
        raise RuntimeError(f"arm {arm} seed {seed} failed: see {run_dir / 'logs'}")
    return run_dir


def greedy_evals(model_dir: Path, rows: list[dict], kv, max_new_tokens: int) -> tuple[float, float]:
    """Greedy pass@1 of an HF checkpoint on `rows` through the embedded engine: dense KV, and under
    `kv` (the demo's compression, also for arm a, whose trainer never decodes compressed)."""
    from benchmarks.bench_warmstart import engine_reward

    dense, _ = engine_reward(model_dir, rows, None, 0.0, max_new_tokens)
    compressed, _ = engine_reward(model_dir, rows, kv, 0.0, max_new_tokens)
    return dense, compressed


def summarize(records: list[dict], target: float) -> dict[str, float]:
    nan = math.nan
    """One run's study numbers from its metrics records."""
    steps = [r for r in records if r["step"] > 0 and r.get("rollout/reward_mean") is not None]
    rewards = [r["rollout/reward_mean"] for r in steps]
    means = [statistics.fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    reached = next((s["train/rollouts"] for s, m in zip(steps, means, strict=True) if m >= target), None)
    synced = [r for r in steps if r.get("sync/patch_bytes") is not None]
    last = {k: next((r[k] for r in reversed(records) if r.get(k) is not None), nan) for k in EVALS}
    return {
        "run_eval_dense": last["eval/pass1_dense"],
        "run_eval_compressed": last["eval/pass1_compressed"],
        "reward_per_rollout": statistics.fmean(rewards),
        "reward_first5": statistics.fmean(rewards[:5]),
        "reward_last5": statistics.fmean(rewards[-5:]),
        "rollouts_to_target": float(reached) if reached is not None else float("nan"),
        "rollouts": float(steps[-1]["train/rollouts"]),
        "peak_kv_bytes": max(r["rollout/peak_kv_bytes"] for r in steps),
        "dense_kv_bytes": max(r["rollout/dense_kv_bytes"] for r in steps),
        "sync_bytes_per_step": statistics.fmean(r["sync/patch_bytes"] for r in synced) if synced else 0.0,
        "dense_sync_bytes": statistics.fmean(r["sync/dense_bytes"] for r in synced) if synced else 0.0,
        "step_s": statistics.fmean(r["time/step_s"] for r in steps),
        "updates": sum(r.get("train/updates", 0.0) for r in steps),
        "dgg_gates": sum(r.get("dgg/gates", 0.0) for r in steps),
        "vetoed": sum(r.get("correction/vetoed_sequences", 0.0) for r in steps),
    }


def _cell(values: list[float], fmt: str = "{:.3f}", missing: str = "never") -> str:
    """'mean (min-max)' over seeds; runs that never reached a value (NaN) are counted, not averaged."""
    finite = [v for v in values if v == v]
    if not finite:
        return missing
    text = fmt.format(statistics.fmean(finite))
    if len(finite) > 1:
        text += f" ({fmt.format(min(finite))}-{fmt.format(max(finite))})"
    return text + (f", {len(values) - len(finite)} {missing}" if len(finite) < len(values) else "")


def print_table(results: dict[str, dict[str, dict]], seeds: list[int], target: float) -> None:
    from sparserl_mcore.telemetry.console import human_bytes

    first = [results[next(iter(results))][str(s)] for s in seeds]
    start = "; ".join(f"{r['start_eval_dense']:.3f} / {r['start_eval_compressed']:.3f}" for r in first)
    print(f"\nwarm start (every arm's start), greedy eval dense / compressed KV, per seed: {start}")
    print(
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}); mean (min-max) over seeds\n"
        "| arm | final eval, dense KV | final eval, compressed KV | run's last eval dense / compr. "
        f"| reward per rollout | rollouts to reward {target} | peak KV / request | sync bytes / step "
        "| s / step | updates / DGG gates | vetoed |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for arm, per_seed in results.items():
        runs = [per_seed[str(s)] for s in seeds if str(s) in per_seed]
        col = {k: [r[k] for r in runs] for k in runs[0]}
        print(
            f"| {arm} {ARMS[arm][0]} | {_cell(col['final_eval_dense'])} "
            f"| {_cell(col['final_eval_compressed'])} "
            f"| {_cell(col['run_eval_dense'])} / {_cell(col['run_eval_compressed'], missing='-')} "
            f"| {_cell(col['reward_per_rollout'])} | {_cell(col['rollouts_to_target'], '{:.0f}')} "
            f"| {human_bytes(max(col['peak_kv_bytes']))} of {human_bytes(max(col['dense_kv_bytes']))} "
            f"| {human_bytes(statistics.fmean(col['sync_bytes_per_step']))} of "
            f"{human_bytes(statistics.fmean(col['dense_sync_bytes']))} | {_cell(col['step_s'], '{:.1f}')} "
            f"| {statistics.fmean(col['updates']):.0f} / {statistics.fmean(col['dgg_gates']):.0f} "
            f"| {statistics.fmean(col['vetoed']):.0f} |"
        )


def plot(results_dir: Path, arms: list[str], seeds: list[int], out_png: Path) -> None:
    """Train reward vs rollouts and both greedy evals vs step, mean over seeds, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparserl_mcore.telemetry import read_metrics

    keys = (
        ("rollout/reward_mean", "train reward (mean over seeds)"),
        ("eval/pass1_dense", "greedy eval, dense KV (64 held-out prompts)"),
        ("eval/pass1_compressed", "greedy eval, compressed KV (64 held-out prompts)"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4.2))
    for arm in arms:
        color = f"C{sorted(ARMS).index(arm)}"  # one color per arm in every panel (a has no compressed eval)
        runs = [read_metrics(results_dir / f"seed{s}" / arm / "metrics.jsonl") for s in seeds]
        for ax, (key, title) in zip(axes, keys, strict=True):
            per_step: dict[int, list[float]] = {}
            for records in runs:
                for r in records:
                    if r.get(key) is not None:
                        per_step.setdefault(r["step"], []).append(r[key])
            xs = sorted(s for s, v in per_step.items() if len(v) == len(runs))
            if xs:
                ax.plot(
                    xs,
                    [statistics.fmean(per_step[s]) for s in xs],
                    marker="o",
                    markersize=2,
                    color=color,
                    label=arm,
                )
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step (same rollouts per step in every arm)")
            ax.grid(alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8, title="arm")
    fig.suptitle("methods study: " + "; ".join(f"{a} = {ARMS[a][0]}" for a in arms), fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from sparserl_mcore.config import load_config
    from sparserl_mcore.demo import DEMO_YAML
    from sparserl_mcore.telemetry import read_metrics
    from sparserl_mcore.telemetry.console import quiet_library_output
    from sparserl_mcore.trainer.warmstart import prepare_policy

    a = _args(argv)
    quiet_library_output()
    out = Path(a.out).resolve()
    results_path = out / "results.json"
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for seed in a.seeds:
        policy = prepare_policy(out / f"seed{seed}", n_eval=64, seed=seed)
        demo = load_config(DEMO_YAML)
        rows = [json.loads(line) for line in policy.eval_path.read_text().splitlines()]
        evals = partial(
            greedy_evals, rows=rows, kv=demo.rollout.kv, max_new_tokens=demo.rollout.sampling.max_new_tokens
        )
        start = dict(zip(("start_eval_dense", "start_eval_compressed"), evals(policy.model_dir), strict=True))
        for arm in a.arms:
            print(f"=== seed {seed}, arm {arm}: {ARMS[arm][0]}", flush=True)
            run_dir = run_arm(out, seed, arm, a.steps)
            row = summarize(read_metrics(run_dir / "metrics.jsonl"), a.target) | start
            row |= dict(
                zip(("final_eval_dense", "final_eval_compressed"), evals(run_dir / "hf"), strict=True)
            )
            results.setdefault(arm, {})[str(seed)] = row
            results_path.write_text(json.dumps(results, indent=1))  # kept after every run
    print_table({arm: results[arm] for arm in a.arms}, a.seeds, a.target)
    plot(out, a.arms, a.seeds, out / "methods.png")
    print(f"results: {results_path}\nplot: {out / 'methods.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
