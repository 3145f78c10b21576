"""Ablations on the demo task (warm-started tiny Qwen2, Fibonacci-mod-10 digit chains, TP=2, gloo).

    python -m benchmarks.bench_ablations [--steps 12] [--out runs/ablations] [--target 0.3]
    (`make bench` / `python -m benchmarks bench_ablations` run it with the defaults)

Two families, every run with the same seed, data, warm start and step count:
  correction: dense GRPO (no KV compression) / compressed rollouts without correction / Sparse-RL
              -> final reward, eval pass@1 under dense and compressed inference, peak KV bytes;
  reuse:      single-use GRPO (K=1) / fixed K=4 reuse / DGG (K<=4)
              -> rollouts needed until the step reward first reaches --target, final reward.
Results print as two tables and are written to OUT/results.json. Numbers from a tiny model on a
toy task over a few steps are noisy: they show the machinery working, not the papers' effect sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ARMS: dict[str, dict[str, list[str]]] = {
    "correction": {
        "dense GRPO": ["rollout.kv.method=none", "loss.correction.mode=off"],
        "compressed, no correction": ["loss.correction.mode=off"],
        "compressed + Sparse-RL": ["loss.correction.mode=sparse_rl"],
    },
    "reuse": {
        "single-use GRPO (K=1)": ["train.reuse_epochs=1", "dgg.enabled=false"],
        "fixed reuse K=4": ["train.reuse_epochs=4", "dgg.enabled=false"],
        "DGG (K<=4)": ["train.reuse_epochs=4", "dgg.enabled=true"],
    },
}


def _run(out: Path, name: str, steps: int, overrides: list[str]) -> list[dict]:
    """One training run through `sparserl train --nproc 2`; returns its metrics records."""
    from sparserl_mcore.trainer.cli import main as train

    run_dir = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
    args = [
        f"train.steps={steps}",
        f"telemetry.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        "checkpoint.every=0",
        "checkpoint.save_hf=null",
        "checkpoint.resume=false",
        "telemetry.plot=false",
        *overrides,
    ]
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if train(str(out / "demo.yaml"), args, nproc=2) != 0:
        raise RuntimeError(f"ablation run {name!r} failed")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return values[-1] if values else float("nan")


def _summary(records: list[dict], target: float) -> dict[str, float]:
    steps = [r for r in records if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in steps]
    reached = next((r["train/rollouts"] for r in steps if r["rollout/reward_mean"] >= target), float("nan"))
    return {
        "final_reward": sum(rewards[-2:]) / len(rewards[-2:]),
        "eval_dense": _last(records, "eval/pass1_dense"),
        "eval_compressed": _last(records, "eval/pass1_compressed"),
        "peak_kv_bytes": max(r.get("rollout/peak_kv_bytes", 0.0) for r in steps),
        "rollouts_to_target": reached,
        "dgg_gates": sum(r.get("dgg/gates", 0.0) for r in steps),
        "updates": sum(r.get("train/updates", 0.0) for r in steps),
    }


def main(argv: list[str]) -> int:
    import yaml
    from rich.console import Console
    from rich.table import Table

    from sparserl_mcore import demo

    parser = argparse.ArgumentParser(prog="bench_ablations", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="runs/ablations")
    parser.add_argument("--target", type=float, default=0.3, help="reward level for rollouts-to-target")
    parser.add_argument("--family", choices=sorted(ARMS), action="append", help="run only these families")
    args = parser.parse_args(argv)
    console = Console()
    out = Path(args.out).resolve()
    demo.prepare(out, console)
    (out / "demo.yaml").write_text(yaml.safe_dump(demo.demo_config(out, args.steps, 2), sort_keys=False))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for family in args.family or sorted(ARMS):
        results[family] = {}
        for name, overrides in ARMS[family].items():
            console.print(f"[bold]{family}: {name}[/]")
            results[family][name] = _summary(_run(out, name, args.steps, overrides), args.target)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    columns = {
        "correction": ("final_reward", "eval_dense", "eval_compressed", "peak_kv_bytes"),
        "reuse": ("rollouts_to_target", "final_reward", "dgg_gates", "updates"),
    }
    for family, arms in results.items():
        table = Table(title=f"ablation: {family} ({args.steps} steps, target reward {args.target})")
        table.add_column("arm")
        for col in columns[family]:
            table.add_column(col, justify="right")
        for name, row in arms.items():
            table.add_row(name, *(f"{row[c]:.4g}" for c in columns[family]))
        console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
