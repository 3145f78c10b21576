"""`sparserl demo` (what `make demo` runs): the whole product on a 2-core CPU in minutes, offline.

1. make a tiny random Qwen2 checkpoint (character-level tokenizer, nothing downloaded);
2. warm-start it with a short supervised phase on the synthetic digit-chain task (Fibonacci mod 10,
   40 digits; trainer/tasks.py), stopped part-way so sampled rewards start clearly above zero;
3. GRPO with TP=2 over 2 gloo processes (torchrun) as configured by examples/demo.yaml, the one
   source of the run's settings: StreamingLLM-compressed rollouts with a KV budget under half the
   generation length, full Sparse-RL correction, DGG with K=4, sparse weight sync every step, eval
   pass@1 under dense and compressed KV;
4. the trainer's summary with the paths it wrote (metrics, plot, checkpoint, HF export), and a
   table of what happened.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEMO_YAML = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="runs/demo", help="run directory (model, data, metrics, checkpoints)"
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: examples/demo.yaml)")
    parser.add_argument("--nproc", type=int, default=2, help="learner ranks (tensor parallel size)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra run-config overrides")


def demo_overrides(out: Path, steps: int | None, tp: int) -> list[str]:
    """What the demo changes in examples/demo.yaml: the paths under `out`, the TP size, the steps."""
    paths = [
        f"model.hf_path={out / 'warm'}",
        f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.eval_path={out / 'data' / 'eval.jsonl'}",
        f"checkpoint.dir={out / 'checkpoints'}",
        f"checkpoint.save_hf={out / 'final_hf'}",
        f"telemetry.dir={out / 'metrics'}",
        f"parallel.tensor_model_parallel_size={tp}",
    ]
    return paths + ([f"train.steps={steps}"] if steps is not None else [])


def demo_config(out: Path, steps: int | None, tp: int, extra: list[str] | tuple[str, ...] = ()) -> dict:
    """examples/demo.yaml with `demo_overrides` and `extra` applied, validated, as a plain dict
    (written to OUT/demo.yaml, so a run can be repeated by hand; bench_ablations derives its arms
    from it)."""
    from sparserl_mcore.config import load_config, to_dict

    return to_dict(load_config(DEMO_YAML, [*demo_overrides(out, steps, tp), *extra]))


def prepare(out: Path, console) -> Path:
    """Steps 1-2 (`prepare_policy` with the DEMO_* presets of trainer/warmstart.py). An existing
    OUT/warm is reused. Returns the warm-started checkpoint directory."""
    from sparserl_mcore.trainer.warmstart import prepare_policy

    with console.status("warm start (supervised)") as status:
        prepared = prepare_policy(
            out, n_eval=64, log=lambda s, loss: status.update(f"warm start: step {s}, loss {loss:.3f}")
        )
    if prepared.result is None:
        console.print(f"reusing warm-started model {prepared.model_dir}")
    else:
        r = prepared.result
        console.print(
            f"warm start: {r.steps} steps, loss {r.final_loss:.3f}, "
            f"teacher-forced exact match {r.final_accuracy:.2f}, {r.seconds:.0f} s"
        )
    return prepared.model_dir


def summary_table(metrics_path: Path, window: int = 5):
    """Reward (mean of the first and last `window` steps) and eval start -> end, peak KV vs dense,
    sync bytes vs dense, DGG updates applied vs gated, vetoes."""
    from rich.table import Table

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r for r in rows if "step" in r and r["step"] > 0]

    def first_last(key: str) -> tuple[float, float]:
        vals = [r[key] for r in rows if key in r]
        return (vals[0], vals[-1]) if vals else (float("nan"), float("nan"))

    table = Table(title="sparserl demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rewards = [r["rollout/reward_mean"] for r in steps if "rollout/reward_mean" in r]
    n = min(window, max(1, len(rewards) // 2))
    table.add_row(
        f"reward (mean of first / last {n} steps)",
        f"{sum(rewards[:n]) / n:.3f} -> {sum(rewards[-n:]) / n:.3f}",
    )
    for key, label in (
        ("eval/pass1_compressed", "eval pass@1 (compressed KV)"),
        ("eval/pass1_dense", "eval pass@1 (dense KV)"),
    ):
        a, b = first_last(key)
        table.add_row(label, f"{a:.3f} -> {b:.3f}")
    peak = max(r.get("rollout/peak_kv_bytes", 0) for r in steps)
    dense = max(r.get("rollout/dense_kv_bytes", 0) for r in steps)
    table.add_row("peak KV bytes per request (compressed / dense)", f"{peak:,.0f} / {dense:,.0f}")
    patch = sum(r.get("sync/patch_bytes", 0) for r in steps)
    full = sum(r.get("sync/dense_bytes", 0) for r in steps)
    table.add_row(
        "sync bytes (sparse / dense BF16)", f"{patch:,.0f} / {full:,.0f} ({full / max(patch, 1):.0f}x)"
    )
    applied = sum(r.get("train/updates", 0) for r in steps)
    gates = sum(r.get("dgg/gates", 0) for r in steps)
    table.add_row("optimizer updates applied / DGG gates", f"{applied:.0f} / {gates:.0f}")
    table.add_row("vetoed sequences", f"{sum(r.get('correction/vetoed_sequences', 0) for r in steps):.0f}")
    return table


def run(args: argparse.Namespace) -> int:
    import yaml
    from rich.console import Console

    from sparserl_mcore.trainer.cli import main as train

    console = Console()
    out = Path(args.out).resolve()
    start = time.perf_counter()
    config = demo_config(out, args.steps, args.nproc, args.overrides)  # fails before any training
    metrics = Path(config["telemetry"]["dir"]) / "metrics.jsonl"
    prepare(out, console)
    cfg_path = out / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    metrics.unlink(missing_ok=True)
    console.print(f"GRPO: TP={args.nproc} over {args.nproc} gloo processes, {DEMO_YAML} -> {cfg_path}")
    code = train(str(cfg_path), ["checkpoint.resume=false"], nproc=args.nproc)
    if code != 0:
        console.print(f"[red]training failed with exit code {code}[/]")
        return code
    console.print(summary_table(metrics))
    console.print(f"total time {time.perf_counter() - start:.0f} s")
    return 0
