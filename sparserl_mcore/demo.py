"""`sparserl demo` (what `make demo` runs): the whole product on a 2-core CPU in minutes, offline.

1. make a tiny random Qwen2 checkpoint (character-level tokenizer, nothing downloaded);
2. warm-start it on demonstrations of the synthetic digit-chain task (Fibonacci mod 10, 24
   digits; trainer/tasks.py) that slip on carry steps, while the reward checks the true chain: the
   warm policy writes the format and most of the rule but greedily gets the carry wrong, and its
   samples find the right carry often enough for GRPO to fix that one rule on every prompt;
3. GRPO with TP=2 over 2 gloo processes (torchrun) as configured by examples/demo.yaml, the one
   source of the run's settings: StreamingLLM-compressed rollouts with a KV budget under the
   generation length, full Sparse-RL correction, K=4 batch reuse (DGG's lm_head signal and the DWD
   weight change logged per update, its gate off: at this K and lr fixed reuse does not degrade and
   gating only cost eval, docs/benchmarks.md "Methods study"; where DGG helps and what it costs:
   "DGG" there), sparse weight sync every step, greedy eval on held-out prompts under dense and
   compressed KV;
4. the trainer's summary with the paths it wrote (metrics, plot, checkpoint, HF export), and a
   table of what happened: start -> end of reward and both evals, what compression and sparse
   sync saved against dense, DGG gates, vetoed sequences.

`--env lookup_chain`: the multi-turn, tool-using demo instead (examples/demo_agent.yaml,
docs/agents.md): the same tiny model warm-started on lookup_chain demonstrations that answer one
hop early half the time, then GRPO over episodes; the table and plot add tool calls per episode.

`--seed S` seeds everything that differs between runs: the task splits, the random init and the
warm start's batch order (trainer/warmstart.py prepare_policy), and the RL run (train.seed).

The whole configuration (overrides, --nproc against the model it will make, the reward, the
output directories) is checked before the warm start: a problem is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sparserl_mcore.cli_args import positive_int

DEMO_YAML = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
AGENT_YAML = DEMO_YAML.with_name("demo_agent.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="runs/demo", help="run directory (model, data, metrics, checkpoints)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="GRPO steps (default: examples/demo.yaml)"
    )
    parser.add_argument("--nproc", type=positive_int, default=2, help="learner ranks (tensor parallel size)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the task data, the model init, the warm start and the RL run",
    )
    parser.add_argument(
        "--env",
        choices=("lookup_chain",),
        default=None,
        help="the multi-turn demo: episodes with this built-in environment (examples/demo_agent.yaml)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra run-config overrides")


def demo_overrides(out: Path, steps: int | None, tp: int, seed: int = 0) -> list[str]:
    """What the demo changes in examples/demo.yaml: the paths under `out`, the TP size, the seed,
    the steps."""
    paths = [
        f"model.hf_path={out / 'warm'}",
        f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.eval_path={out / 'data' / 'eval.jsonl'}",
        f"checkpoint.dir={out / 'checkpoints'}",
        f"checkpoint.save_hf={out / 'final_hf'}",
        f"telemetry.dir={out / 'metrics'}",
        f"parallel.tensor_model_parallel_size={tp}",
        f"train.seed={seed}",
    ]
    return paths + ([f"train.steps={steps}"] if steps is not None else [])


def demo_config(
    out: Path,
    steps: int | None,
    tp: int,
    extra: list[str] | tuple[str, ...] = (),
    *,
    seed: int = 0,
    yaml_path: Path = DEMO_YAML,
) -> dict:
    """examples/demo.yaml with `demo_overrides` and `extra` applied, validated, as a plain dict
    (written to OUT/demo.yaml, so a run can be repeated by hand; bench_methods derives its arms
    from it)."""
    from sparserl_mcore.config import load_config, to_dict

    return to_dict(load_config(yaml_path, [*demo_overrides(out, steps, tp, seed), *extra]))


def prepare(out: Path, console, seed: int = 0, env: str | None = None) -> Path:
    """Steps 1-2 (`prepare_policy` with the DEMO_* presets of trainer/warmstart.py, or with `env`
    `prepare_lookup_policy`). An OUT/warm made from the same recipe and seed is reused. Returns the
    warm-started checkpoint directory."""
    from sparserl_mcore.trainer.warmstart import prepare_lookup_policy, prepare_policy

    prepare_fn = prepare_lookup_policy if env == "lookup_chain" else prepare_policy
    with console.status("warm start (supervised)") as status:
        prepared = prepare_fn(
            out,
            n_eval=64,
            seed=seed,
            log=lambda s, loss: status.update(f"warm start: step {s}, loss {loss:.3f}"),
        )
    if prepared.result is None:
        console.print(f"reusing warm-started model {prepared.model_dir}", soft_wrap=True)
    else:
        r = prepared.result
        console.print(f"warm start: {r.steps} steps, loss {r.final_loss:.3f}, {r.seconds:.0f} s")
    return prepared.model_dir


def summary_table(metrics_path: Path, window: int = 5):
    """Reward (mean of the first and last `window` steps) and both greedy evals start -> end, peak KV
    per request and weight-sync bytes against dense, optimizer updates applied and DGG gates, vetoed
    sequences: what the demo shows, human-formatted."""
    from rich.table import Table

    from sparserl_mcore.telemetry import read_metrics
    from sparserl_mcore.telemetry.console import human_bytes, times

    rows = read_metrics(metrics_path)
    steps = [r for r in rows if r["step"] > 0]
    table = Table(title="sparserl demo")
    table.add_column("metric")
    table.add_column("start -> end / used vs dense", justify="right")
    rewards = [r["rollout/reward_mean"] for r in steps if r.get("rollout/reward_mean") is not None]
    n = min(window, max(1, len(rewards) // 2))
    if rewards:
        first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
        table.add_row(f"train reward (mean of first / last {n} steps)", f"{first:.3f} -> {last:.3f}")
    for key, label in (
        ("eval/pass1_compressed", "greedy eval, compressed KV"),
        ("eval/pass1_dense", "greedy eval, dense KV"),
    ):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            table.add_row(label, f"{values[0]:.3f} -> {values[-1]:.3f} ({values[-1] - values[0]:+.3f})")
    for used, dense, label, total in (
        ("rollout/peak_kv_bytes", "rollout/dense_kv_bytes", "peak KV per request", max),
        ("sync/patch_bytes", "sync/dense_bytes", "weight sync, all steps", sum),
    ):
        a, b = (total([0.0, *(r.get(k) or 0.0 for r in steps)]) for k in (used, dense))
        if a and b:
            table.add_row(
                f"{label} (vs dense)", f"{human_bytes(a)} vs {human_bytes(b)} ({times(b / a)} less)"
            )
    turns = [r["agent/turns_mean"] for r in steps if r.get("agent/turns_mean") is not None]
    if turns:
        m = min(window, max(1, len(turns) // 2))
        first, last = sum(turns[:m]) / m, sum(turns[-m:]) / m
        table.add_row(f"policy turns per episode (first / last {m} steps)", f"{first:.2f} -> {last:.2f}")
    applied = sum(r.get("train/updates") or 0 for r in steps)
    gates = sum(r.get("dgg/gates") or 0 for r in steps)
    table.add_row("optimizer updates applied / gated by DGG", f"{applied:.0f} / {gates:.0f}")
    vetoed = sum(r.get("correction/vetoed_sequences") or 0 for r in steps)
    sampled = sum(r.get("train/sequences") or 0 for r in steps)
    table.add_row("sequences vetoed by Sparse-RL", f"{vetoed:.0f} of {sampled:.0f}")
    return table


def checked_config(out: Path, args: argparse.Namespace) -> dict:
    """`demo_config` once everything that can be checked before the model and data exist passed
    (`preflight.check_before_assets` with the shape of the model the warm start makes); raises
    ConfigError / PreflightError."""
    from sparserl_mcore.ckpt.atomic import output_problem
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.trainer.preflight import PreflightError, check_before_assets
    from sparserl_mcore.trainer.warmstart import DEMO_MODEL

    problem = output_problem(out)
    if problem:
        raise PreflightError(f"--out {problem}")
    yaml_path = AGENT_YAML if args.env else DEMO_YAML
    config = demo_config(out, args.steps, args.nproc, args.overrides, seed=args.seed, yaml_path=yaml_path)
    shape = {
        "num_layers": DEMO_MODEL.layers,
        "num_heads": DEMO_MODEL.heads,
        "num_kv_heads": DEMO_MODEL.kv_heads,
    }
    check_before_assets(config_from_dict(config), world_size=args.nproc, **shape)
    return config


def run(args: argparse.Namespace) -> int:
    import yaml
    from rich.console import Console

    from sparserl_mcore.config import ConfigError
    from sparserl_mcore.telemetry.console import quiet_library_output
    from sparserl_mcore.trainer.cli import main as train
    from sparserl_mcore.trainer.preflight import PreflightError

    quiet_library_output()
    console = Console()
    out = Path(args.out).resolve()
    start = time.perf_counter()
    try:
        config = checked_config(out, args)
    except (ConfigError, PreflightError) as exc:
        print(f"sparserl demo: {exc}", file=sys.stderr)
        return 2
    metrics = Path(config["telemetry"]["dir"]) / "metrics.jsonl"
    prepare(out, console, args.seed, args.env)
    cfg_path = out / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    metrics.unlink(missing_ok=True)
    tp, islands = config["parallel"]["tensor_model_parallel_size"], config["parallel"]["islands"]
    layout = f"TP={tp}" + (f", {islands} islands" if islands > 1 else "")
    console.print(f"GRPO: {layout} over {args.nproc} gloo processes, config {cfg_path}", soft_wrap=True)
    code = train(str(cfg_path), ["checkpoint.resume=false"], nproc=args.nproc)
    if code != 0:
        console.print(f"[red]training failed with exit code {code}[/]")
        return code
    console.print(summary_table(metrics))
    console.print(f"total time {time.perf_counter() - start:.0f} s")
    return 0
