"""What DGG buys: does heavy batch reuse degrade here, and does the gate prevent it (issue 26).

    python -m benchmarks.bench_dgg sweep   [--task demo|worked] [--runs K:LR:STEPS ...] [--seed S]
    python -m benchmarks.bench_dgg compare [--task demo|worked] --reuse K --lr LR --steps N --tau T
                                           [--seeds 0 1 2] [--arms k1 fixed dgg]
    python -m benchmarks.bench_dgg report  [--task demo|worked] [--seeds S ...]  # tables + PNGs from what ran
    python -m benchmarks bench_dgg                                  # = compare at the defaults below

Every run is `sparserl train --nproc 2` of examples/demo.yaml as `sparserl demo --seed S` sets it
up (demo.demo_config; TP=2, StreamingLLM budget 16, Sparse-RL, 16 prompts x G=8 per step), from
that seed's warm start of the task (trainer.warmstart.prepare_policy with the demo's model and
schedule), with reuse K (train.reuse_epochs), Adam lr, steps and DGG set per run:
  sweep    fixed reuse (DGG off: z is logged, nothing is gated) for each K:LR:STEPS, one seed:
           where does fixed reuse degrade while K=1 keeps learning, and what does the DWD signal
           (lm_head vs middle-layer relative weight change per update) do before it?
  compare  at one setting: K=1 (single use), fixed reuse K, and K with DGG at tau, per seed.
Tasks: `demo` (DEMO_TASK, 24-digit chains, reward digit_chain) and `worked` (WORKED_TASK: the same
chains with the work shown, 12 steps `a+b=c`, a 71-token answer, reward worked_chain).
Per run (OUT/<task>/runs/<name>/: the run's metrics.jsonl, updates.jsonl, summary.png, and
result.json as it ends): reward (5-step running mean: first, peak, last), rollouts until it first
reached --target, the run's greedy evals (dense and compressed KV, every 10 steps), updates applied
and gated, passes per batch, the DWD signal per reuse index k (lm_head and middle-layer relative
change per update and their ratio, at the first and the last pass over a batch) and per step (the
ratio's mean over the first and the last 5 steps), lm_head's share of the gradient norm (first and
last 5 steps), wall s / step. A run "degrades" when it ends
below where it started (last-5 reward under the first-5) or its final dense eval is >= 0.05 under
its best. Prints markdown tables (the sweep, what the gate sees in it, the compare means over seeds,
and every arm x seed with the runs that are missing or never finished named as such); writes
OUT/<task>/{sweep,compare}.png. Results: docs/benchmarks.md,
"DGG: what batch reuse and the gate do".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.bench_methods import _cell  # 'mean (min-max)' over seeds, "never" counted

EVALS = ("eval/pass1_dense", "eval/pass1_compressed")
RUN = ["checkpoint.every=0", "checkpoint.resume=false", "telemetry.plot=true", "telemetry.progress=false"]
TAUS = (0.1, 0.5, 2.0)  # the z thresholds tried; a fixed-reuse run shows what each would gate
DROP = 0.05  # "degrades": the final dense eval this far below the run's best


@dataclass(frozen=True)
class TaskSetup:
    reward: str
    max_new_tokens: int

    def task(self):
        from sparserl_mcore.trainer.tasks import DEMO_TASK, WORKED_TASK

        return {"digit_chain": DEMO_TASK, "worked_chain": WORKED_TASK}[self.reward]

    def overrides(self) -> list[str]:
        return [f"reward.name={self.reward}", f"rollout.sampling.max_new_tokens={self.max_new_tokens}"]


# max_new_tokens: the answer, EOS and one token of slack (the demo's 26 for 24 digits)
TASKS = {"demo": TaskSetup("digit_chain", 26), "worked": TaskSetup("worked_chain", 73)}
# A sweep's default grid, most informative first: the heaviest reuse at the demo's lr, then the
# lrs at which K=1 still learns, heaviest reuse first.
SWEEP = [
    "16:1e-4:40",
    "1:3e-4:40",
    "16:3e-4:40",
    "4:3e-4:40",
    "8:3e-4:40",
    "1:1e-3:40",
    "4:1e-3:40",
    "16:1e-3:40",
]


def run_name(reuse: int, lr: float, steps: int, tau: float | None) -> str:
    return f"K{reuse}-lr{lr:g}-n{steps}-" + ("fixed" if tau is None else f"dgg{tau:g}")


def prepare(out: Path, task: str, seed: int):
    """The seed's data splits and warm-started policy (reused when already made from this recipe)."""
    from sparserl_mcore.trainer.warmstart import prepare_policy

    return prepare_policy(out / f"seed{seed}", task=TASKS[task].task(), n_eval=64, seed=seed)


def train_run(out: Path, task: str, seed: int, reuse: int, lr: float, steps: int, tau: float | None) -> Path:
    """One training run from seed `seed`'s warm start; returns its run directory."""
    from sparserl_mcore.demo import demo_config
    from sparserl_mcore.trainer.cli import main as train

    run_dir = out / "runs" / f"s{seed}-{run_name(reuse, lr, steps, tau)}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume, no stale metrics
    run_dir.mkdir(parents=True)
    overrides = [
        *TASKS[task].overrides(),
        f"train.reuse_epochs={reuse}",
        f"optimizer.lr={lr}",
        f"dgg.enabled={str(tau is not None).lower()}",
        *([f"dgg.tau={tau}"] if tau is not None else []),
        *RUN,
        f"telemetry.dir={run_dir}",
        "checkpoint.dir=null",  # only the metrics are studied: no checkpoint, no HF export
        "checkpoint.save_hf=null",
    ]
    config = demo_config(out / f"seed{seed}", steps, 2, overrides, seed=seed)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if train(str(run_dir / "config.yaml"), [], nproc=2) != 0:
        raise RuntimeError(f"{run_dir.name} failed: see {run_dir / 'logs'}")
    return run_dir


def _running_mean(values: list[float], n: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else math.nan


def _by_reuse_index(updates: list[dict]) -> dict[str, dict[str, float]]:
    """Per reuse index k (1 = first pass over a batch): the mean DWD numbers and lm_head energy of
    its applied updates, and how many updates DGG gated at k."""
    out: dict[str, dict[str, float]] = {}
    for k in sorted({int(u["dgg/reuse_index"]) for u in updates}):
        at_k = [u for u in updates if int(u["dgg/reuse_index"]) == k]
        out[str(k)] = {
            "ratio": _mean(at_k, "dwd/ratio"),
            "lm_head": _mean(at_k, "dwd/lm_head_rel_change"),
            "middle": _mean(at_k, "dwd/middle_rel_change"),
            "energy": _mean(at_k, "dgg/lm_head_grad_sq"),
            "gated": float(sum(u.get("dgg/gated", 0.0) for u in at_k)),
            "updates": float(len(at_k)),
            **{f"z_over_{tau:g}": _share(at_k, tau) for tau in TAUS},
        }
    return out


def _share(updates: list[dict], tau: float) -> float:
    """Share of the updates whose z-score exceeds tau: what DGG at tau would gate (k > 1)."""
    zs = [u["dgg/z"] for u in updates if u.get("dgg/z") is not None]
    return sum(z > tau for z in zs) / len(zs) if zs else math.nan


def _head_share(updates: list[dict]) -> dict[str, float]:
    """lm_head's share of the global gradient norm (before clipping), mean over the applied updates
    of the first and of the last 5 steps: the paper has it spike at collapse."""
    applied = [u for u in updates if u.get("train/grad_norm")]
    steps = sorted({u["step"] for u in applied})

    def share(chosen: list[int]) -> float:
        return _mean(
            [
                {"x": u["dgg/lm_head_grad_norm"] / u["train/grad_norm"]}
                for u in applied
                if u["step"] in chosen
            ],
            "x",
        )

    return {"head_share_first5": share(steps[:5]), "head_share_last5": share(steps[-5:])}


def summarize(run_dir: Path, target: float) -> dict:
    """One run's numbers from its metrics.jsonl and updates.jsonl (see the module docstring)."""
    from sparserl_mcore.telemetry import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    updates = read_metrics(run_dir / "updates.jsonl")
    steps = [r for r in records if r["step"] > 0 and r.get("rollout/reward_mean") is not None]
    smooth = _running_mean([r["rollout/reward_mean"] for r in steps])
    peak = max(range(len(smooth)), key=smooth.__getitem__)
    reached = next((s["train/rollouts"] for s, m in zip(steps, smooth, strict=True) if m >= target), None)
    evals = {k: [(r["step"], r[k]) for r in records if r.get(k) is not None] for k in EVALS}
    dense = [v for _, v in evals[EVALS[0]]]
    row = {
        "reward_first5": smooth[min(4, len(smooth) - 1)],
        "reward_peak5": smooth[peak],
        "peak_step": steps[peak]["step"],
        "reward_last5": smooth[-1],
        "rollouts_to_target": float(reached) if reached is not None else math.nan,
        "rollouts": float(steps[-1]["train/rollouts"]),
        "eval_dense_max": max(dense, default=math.nan),
        "eval_dense_final": dense[-1] if dense else math.nan,
        "eval_compressed_final": evals[EVALS[1]][-1][1] if evals[EVALS[1]] else math.nan,
        "evals": evals,
        "updates": sum(r.get("train/updates", 0.0) for r in steps),
        "gates": sum(r.get("dgg/gates", 0.0) for r in steps),
        "epochs_mean": _mean(steps, "train/epochs"),
        "step_s": statistics.fmean(r["time/step_s"] for r in steps),
        "ratio_first5": _mean(steps[:5], "dwd/ratio"),
        "ratio_last5": _mean(steps[-5:], "dwd/ratio"),
        "by_k": _by_reuse_index(updates),
        **_head_share(updates),
    }
    row["degrades"] = bool(
        row["reward_last5"] < row["reward_first5"] or row["eval_dense_max"] - row["eval_dense_final"] >= DROP
    )
    return row


def run_and_record(
    out: Path, task: str, seed: int, reuse: int, lr: float, steps: int, tau, target: float, rerun: bool
) -> dict:
    name = run_name(reuse, lr, steps, tau)
    done = out / "runs" / f"s{seed}-{name}" / "result.json"
    if done.is_file() and not rerun:  # the same run, made by a sweep or an earlier compare
        print(f"=== {task} seed {seed}: {name} (ran before: {done})", flush=True)
        return json.loads(done.read_text())
    print(f"=== {task} seed {seed}: {name}", flush=True)
    run_dir = train_run(out, task, seed, reuse, lr, steps, tau)
    row = {"seed": seed, "reuse": reuse, "lr": lr, "steps": steps, "tau": tau} | summarize(run_dir, target)
    done.write_text(json.dumps(row, indent=1))
    return row


def load_results(out: Path, target: float) -> list[dict]:
    """Every finished run under OUT/runs, summarized again from its metrics (the current code's numbers)."""
    rows = []
    for path in sorted((out / "runs").glob("*/result.json")):
        row = json.loads(path.read_text())
        rows.append(
            {k: row[k] for k in ("seed", "reuse", "lr", "steps", "tau")} | summarize(path.parent, target)
        )
    return rows


def _f(value: float, fmt: str = "{:.3f}") -> str:
    return "-" if value != value else fmt.format(value)


def _evals(r: dict) -> str:
    return " ".join(f"{v:.2f}" for _, v in r["evals"][EVALS[0]])


def _at_k(r: dict, key: str, fmt: str) -> str:
    """`key` at the first and the last pass over a batch (k = 1 -> k = the run's largest)."""
    by_k = r["by_k"]
    return f"{_f(by_k['1'][key], fmt)} -> {_f(by_k[max(by_k, key=int)][key], fmt)}" if by_k else "-"


def sweep_table(rows: list[dict]) -> str:
    head = (
        "| K | lr | steps | reward 5-step mean: first -> peak (step) -> last | dense eval every 10 steps "
        "| compressed final | degrades | lm_head change k=1 -> k=K | middle change k=1 -> k=K "
        "| ratio k=1 -> k=K | ratio first -> last 5 steps "
        "| lm_head share of grad norm, first -> last 5 steps "
        "| s / step |\n" + "|---" * 13 + "|"
    )
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["lr"], r["reuse"], r["steps"])):
        lines.append(
            f"| {r['reuse']} | {r['lr']:g} | {r['steps']} | {_f(r['reward_first5'])} -> "
            f"{_f(r['reward_peak5'])} ({r['peak_step']}) -> {_f(r['reward_last5'])} | {_evals(r)} "
            f"| {_f(r['eval_compressed_final'])} | {'**yes**' if r['degrades'] else 'no'} "
            f"| {_at_k(r, 'lm_head', '{:.1e}')} | {_at_k(r, 'middle', '{:.1e}')} "
            f"| {_at_k(r, 'ratio', '{:.2f}')} "
            f"| {_f(r['ratio_first5'], '{:.2f}')} -> {_f(r['ratio_last5'], '{:.2f}')} "
            f"| {_f(r['head_share_first5'], '{:.2f}')} -> {_f(r['head_share_last5'], '{:.2f}')} "
            f"| {r['step_s']:.1f} |"
        )
    return "\n".join(lines)


def gate_view_table(rows: list[dict]) -> str:
    """What DGG sees in the fixed-reuse runs (z logged, nothing gated): the lm_head energy at the
    second and the last pass relative to the first, and the share of updates a tau would gate."""
    lines = [
        "| K | lr | energy k=2 / k=1 | energy k=K / k=1 | z > 0.1 / 0.5 / 2 at k=2 "
        "| z > 0.1 / 0.5 / 2 at k>=3 |\n" + "|---" * 6 + "|"
    ]
    for r in sorted(rows, key=lambda r: (r["lr"], r["reuse"])):
        by_k = r["by_k"]
        if r["reuse"] < 2 or "2" not in by_k:
            continue
        last = by_k[max(by_k, key=int)]
        late = [u for k, u in by_k.items() if int(k) >= 3]
        second = " / ".join(f"{by_k['2'][f'z_over_{t:g}']:.2f}" for t in TAUS)
        late_share = [
            sum(u[f"z_over_{t:g}"] * u["updates"] for u in late) / max(1.0, sum(u["updates"] for u in late))
            for t in TAUS
        ]
        lines.append(
            f"| {r['reuse']} | {r['lr']:g} | {by_k['2']['energy'] / by_k['1']['energy']:.2f} "
            f"| {last['energy'] / by_k['1']['energy']:.2f} "
            f"| {second} "
            f"| {' / '.join(f'{v:.2f}' for v in late_share) if late else '-'} |"
        )
    return "\n".join(lines)


def _k1_finals(rows: list[dict]) -> dict[int, float]:
    """Per seed: the final dense eval of its K=1 run, the bar every arm is measured against."""
    return {r["seed"]: r["eval_dense_final"] for r in rows if r["reuse"] == 1 and r["tau"] is None}


def _rollouts_to(r: dict, bar: float) -> float:
    """Rollouts until the first eval (after step 0) at which the run's dense eval reached `bar`."""
    hit = next((s for s, v in r["evals"][EVALS[0]] if s > 0 and v >= bar), None)
    return hit * r["rollouts"] / r["steps"] if hit is not None else math.nan


def _missing(out: Path, seed: int, name: str, steps: int) -> str:
    """Why a cell has no result: never started, or stopped before it wrote result.json."""
    from sparserl_mcore.telemetry import read_metrics

    metrics = out / "runs" / f"s{seed}-{name}" / "metrics.jsonl"
    if not metrics.is_file():
        return "not run"
    last = max((r["step"] for r in read_metrics(metrics)), default=0)
    return f"unfinished: stopped at step {last} of {steps}, no result"


def per_seed_table(out: Path, rows: list[dict], names: list[str], seeds: list[int], steps: int) -> str:
    """Every arm x seed, the missing ones named: the pairs behind compare_table's means."""
    k1 = _k1_finals(rows)
    done = {(r["seed"], run_name(r["reuse"], r["lr"], r["steps"], r["tau"])): r for r in rows}
    lines = [
        "| arm | seed | dense eval every 10 steps | compressed final | rollouts to K=1's final dense eval "
        "| degrades | updates / gates |\n" + "|---" * 7 + "|"
    ]
    for name in names:
        for seed in seeds:
            r = done.get((seed, name))
            if r is None:
                lines.append(f"| {name} | {seed} | {_missing(out, seed, name, steps)} | | | | |")
                continue
            to_k1 = _rollouts_to(r, k1.get(seed, math.inf))
            lines.append(
                f"| {name} | {seed} | {_evals(r)} | {_f(r['eval_compressed_final'])} "
                f"| {'never' if to_k1 != to_k1 else f'{to_k1:.0f}'} | {'**yes**' if r['degrades'] else 'no'} "
                f"| {r['updates']:.0f} / {r['gates']:.0f} |"
            )
    return "\n".join(lines)


def compare_table(rows: list[dict], target: float) -> str:
    """Per arm, mean (min-max) over seeds; 'rollouts to K=1's final eval': the first eval step at which
    the run's dense eval reached the same seed's K=1 run's final dense eval."""
    k1 = _k1_finals(rows)
    lines = [
        "| arm | seeds | final eval dense | final eval compressed | best dense eval | reward last 5 "
        f"| rollouts to reward {target} | rollouts to K=1's final dense eval | degrades | updates / gates "
        "| passes per batch | s / step |\n" + "|---" * 12 + "|"
    ]
    arms: dict[str, list[dict]] = {}
    for r in rows:
        arms.setdefault(run_name(r["reuse"], r["lr"], r["steps"], r["tau"]), []).append(r)
    for name, runs in sorted(arms.items(), key=lambda kv: (kv[1][0]["reuse"], kv[1][0]["tau"] is not None)):
        col = {k: [r[k] for r in runs] for k in runs[0] if not isinstance(runs[0][k], dict)}
        to_k1 = [_rollouts_to(r, k1.get(r["seed"], math.inf)) for r in runs]
        lines.append(
            f"| {name} | {', '.join(str(s) for s in col['seed'])} | {_cell(col['eval_dense_final'])} "
            f"| {_cell(col['eval_compressed_final'])} | {_cell(col['eval_dense_max'])} "
            f"| {_cell(col['reward_last5'])} | {_cell(col['rollouts_to_target'], '{:.0f}')} "
            f"| {_cell(to_k1, '{:.0f}')} | {sum(col['degrades'])} of {len(runs)} "
            f"| {statistics.fmean(col['updates']):.0f} / {statistics.fmean(col['gates']):.0f} "
            f"| {_cell(col['epochs_mean'], '{:.1f}')} | {_cell(col['step_s'], '{:.1f}')} |"
        )
    return "\n".join(lines)


def _curve(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_sweep(out: Path, rows: list[dict], png: Path) -> None:
    """Per lr (columns): reward (5-step mean, solid) and dense eval (dashed) per K; DWD ratio per K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparserl_mcore.telemetry import read_metrics

    lrs = sorted({r["lr"] for r in rows})
    ks = sorted({r["reuse"] for r in rows})
    fig, axes = plt.subplots(2, len(lrs), figsize=(5 * len(lrs), 8), squeeze=False)
    for col, lr in enumerate(lrs):
        for r in sorted((r for r in rows if r["lr"] == lr), key=lambda r: r["reuse"]):
            name = f"s{r['seed']}-{run_name(r['reuse'], r['lr'], r['steps'], r['tau'])}"
            records = read_metrics(out / "runs" / name / "metrics.jsonl")
            color = f"C{ks.index(r['reuse'])}"
            steps, rewards = _curve([x for x in records if x["step"] > 0], "rollout/reward_mean")
            axes[0, col].plot(steps, _running_mean(rewards), color=color, label=f"K={r['reuse']} reward")
            axes[0, col].plot(
                *_curve(records, EVALS[0]),
                "--o",
                color=color,
                markersize=3,
                label=f"K={r['reuse']} dense eval",
            )
            steps, ratio = _curve(records, "dwd/ratio")
            axes[1, col].plot(steps, _running_mean(ratio), color=color, label=f"K={r['reuse']}")
        axes[0, col].set_title(f"lr {lr:g}: train reward (5-step mean) and greedy eval", fontsize=10)
        axes[1, col].set_title(f"lr {lr:g}: DWD, lm_head / middle-layer change (5-step mean)", fontsize=10)
        for ax in axes[:, col]:
            ax.set_xlabel("RL step (128 rollouts each)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in rows}))
    fig.suptitle(f"{out.name} task: fixed reuse sweep, seed {seeds}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_compare(out: Path, rows: list[dict], png: Path) -> None:
    """Mean over seeds per arm: reward vs rollouts, both greedy evals vs step, DWD ratio vs step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparserl_mcore.telemetry import read_metrics

    keys = (
        ("rollout/reward_mean", "train reward (5-step mean) vs rollouts"),
        (EVALS[0], "greedy eval, dense KV"),
        (EVALS[1], "greedy eval, compressed KV"),
        ("dwd/ratio", "DWD: lm_head / middle-layer change (5-step mean)"),
    )
    arms: dict[str, list[dict]] = {}
    for r in rows:
        arms.setdefault(run_name(r["reuse"], r["lr"], r["steps"], r["tau"]), []).append(r)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.2))
    for i, (name, runs) in enumerate(sorted(arms.items())):
        recs = [read_metrics(out / "runs" / f"s{r['seed']}-{name}" / "metrics.jsonl") for r in runs]
        for ax, (key, title) in zip(axes, keys, strict=True):
            per_step: dict[int, list[float]] = {}
            rollouts: dict[int, float] = {}
            for records in recs:
                for r in records:
                    if r.get(key) is not None and (r["step"] > 0 or key in EVALS):
                        per_step.setdefault(r["step"], []).append(r[key])
                        rollouts[r["step"]] = r.get("train/rollouts", 0.0)
            xs = sorted(s for s, v in per_step.items() if len(v) == len(recs))
            ys = [statistics.fmean(per_step[s]) for s in xs]
            if key == "rollout/reward_mean":
                xs, ys = [rollouts[s] for s in xs], _running_mean(ys)
            elif key == "dwd/ratio":
                ys = _running_mean(ys)
            ax.plot(xs, ys, marker="o", markersize=2, color=f"C{i}", label=f"{name} ({len(recs)} seeds)")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("rollouts" if key == "rollout/reward_mean" else "RL step")
            ax.grid(alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{out.name} task: K=1 vs fixed reuse vs DGG, mean over seeds per arm")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def report_compare(out: Path, rows: list[dict], a: argparse.Namespace) -> None:
    """The compare tables and PNG at --reuse/--lr/--steps: every tau run and the --also Ks, means over
    seeds (report: only --seeds when given), then every arm x seed with the missing runs named."""
    fixed = {1, a.reuse, *a.also}
    chosen = [
        r
        for r in rows
        if r["lr"] == a.lr
        and r["steps"] == a.steps
        and ((r["tau"] is None and r["reuse"] in fixed) or (r["tau"] is not None and r["reuse"] == a.reuse))
        and (a.mode != "report" or a.seeds is None or r["seed"] in a.seeds)
    ]
    print(f"\n{a.task}: K=1 vs fixed K={a.reuse} vs DGG at every tau run, lr {a.lr:g}, {a.steps} steps\n")
    print(compare_table(chosen, a.target))
    expected = {"k1": (1, None), "fixed": (a.reuse, None), "dgg": (a.reuse, a.tau)}
    arms = sorted(
        {expected[arm] for arm in a.arms} | {(r["reuse"], r["tau"]) for r in chosen},
        key=lambda arm: (arm[0], arm[1] is not None, arm[1] or 0.0),
    )
    seeds = sorted({*(a.seeds or []), *(r["seed"] for r in chosen)})
    names = [run_name(reuse, a.lr, a.steps, tau) for reuse, tau in arms]
    print(f"\n{a.task}: per seed, every arm named above or run (the missing ones say why)\n")
    print(per_seed_table(out, chosen, names, seeds, a.steps))
    if chosen:
        plot_compare(out, chosen, out / "compare.png")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_dgg", description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="compare", choices=["sweep", "compare", "report"])
    p.add_argument("--task", default="demo", choices=sorted(TASKS))
    p.add_argument("--out", default="runs/dgg", help="work directory (warm starts, runs, results)")
    p.add_argument("--target", type=float, default=0.3, help="5-step mean reward for 'rollouts to target'")
    p.add_argument("--runs", nargs="+", default=SWEEP, help="sweep: K:LR:STEPS per run, in order")
    p.add_argument("--seed", type=int, default=0, help="sweep: the seed")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="compare: the seeds to run (default 0 1 2); report: only these seeds (default: every seed run)",
    )
    p.add_argument("--arms", nargs="+", default=["k1", "fixed", "dgg"], choices=["k1", "fixed", "dgg"])
    p.add_argument("--reuse", type=int, default=16, help="compare: K of the fixed and DGG arms")
    p.add_argument("--lr", type=float, default=3e-4, help="compare: Adam lr of every arm")
    p.add_argument("--steps", type=int, default=40, help="compare: RL steps of every arm")
    p.add_argument("--tau", type=float, default=0.5, help="compare: DGG's z-score threshold")
    p.add_argument("--rerun", action="store_true", help="train again runs that have a result.json")
    p.add_argument("--also", type=int, nargs="*", default=[], help="report: more fixed-reuse Ks to list")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from sparserl_mcore.telemetry.console import quiet_library_output

    a = _args(argv)
    quiet_library_output()
    out = Path(a.out).resolve() / a.task
    if a.mode == "sweep":
        prepare(out, a.task, a.seed)
        for spec in a.runs:
            reuse, lr, steps = spec.split(":")
            run_and_record(out, a.task, a.seed, int(reuse), float(lr), int(steps), None, a.target, a.rerun)
    elif a.mode == "compare":
        arms = {"k1": (1, None), "fixed": (a.reuse, None), "dgg": (a.reuse, a.tau)}
        for seed in a.seeds or [0, 1, 2]:
            prepare(out, a.task, seed)
            for arm in a.arms:
                reuse, tau = arms[arm]
                run_and_record(out, a.task, seed, reuse, a.lr, a.steps, tau, a.target, a.rerun)
    rows = load_results(out, a.target)
    sweep = [r for r in rows if r["tau"] is None and r["seed"] == (a.seed if a.mode == "sweep" else 0)]
    print(f"\n{a.task}: sweep (seed 0 unless given, fixed reuse)\n{sweep_table(sweep)}")
    if sweep:
        plot_sweep(out, sweep, out / "sweep.png")
        print(f"\n{a.task}: what DGG sees in those runs (z logged, gate off)\n{gate_view_table(sweep)}")
    if a.mode != "sweep":
        report_compare(out, rows, a)
    print(f"results: {out / 'runs'}/*/result.json; plots: {out}/{{sweep,compare}}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
