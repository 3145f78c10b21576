"""One RL step of the demo task, split into rollout, learner update and sync: GPU vs the CPU demo.

Both runs train the demo's warm-started tiny Qwen2 (`sparserl demo`'s preparation, reused when
OUT/warm exists) with examples/demo.yaml for `--steps` steps, no evaluation and no checkpoints:
- GPU: one rank, TP=1, bf16 params (the GPU default), the embedded engine on the same GPU;
- CPU: the demo's own layout, TP=2 over 2 gloo processes, fp32, `CUDA_VISIBLE_DEVICES=""`.
Per step the trainer logs its phases' wall times (time/rollout_s, time/update_s, time/sync_s,
time/step_s); the first step (warm-up: compilation, allocator) is left out, the rest are
medians. The goal is a faster GPU step.

    python -m benchmarks.gpu.trainer [--steps 6] [--cpu-nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import yaml

from benchmarks.gpu import common

PHASES = ("rollout", "update", "sync", "step")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.trainer", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cpu-nproc", type=int, default=2, help="ranks of the CPU run (the demo: 2)")
    p.add_argument("--work", type=Path, default=Path("runs/gpu-bench-trainer"))
    p.add_argument("--skip-cpu", action="store_true", help="GPU run only")
    p.add_argument("--smoke", action="store_true", help="2 steps, CPU only (no figures)")
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.steps = 3
    return args


def _config(work: Path, name: str, steps: int, tp: int, dtype: str) -> Path:
    from sparserl_mcore.demo import demo_config

    cfg = demo_config(work, steps, tp, [f"model.params_dtype={dtype}", "eval.at_start=false"])
    cfg["checkpoint"] = {"dir": None, "every": 0, "save_hf": None}
    cfg["eval"]["every"] = steps  # evaluated inside the last step only: not part of the others
    cfg["telemetry"] = {**cfg["telemetry"], "dir": str(work / name), "plot": False, "progress": True}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(config: Path, nproc: int, steps: int, env: dict[str, str]) -> float:
    """Train (output passed through); seconds from the last step's line to the launcher's exit."""
    import launchers.train
    from sparserl_mcore.parallel.launch import torchrun_command

    script = str(Path(launchers.train.__file__).resolve())
    cmd = torchrun_command([script, "--config", str(config)], nproc, log_dir=config.parent / "torchrun")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    last = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith(f"step {steps} "):
            last = time.monotonic()
    if proc.wait() != 0 or last is None:
        raise SystemExit(f"{cmd[-3]} exited {proc.returncode} (last step line seen: {last is not None})")
    return time.monotonic() - last


def _phases(metrics: Path, steps: int) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [
        r for r in rows if "time/step_s" in r and 1 < r.get("step", 0) < steps
    ]  # skip warm-up, eval step
    return {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in timed) for p in PHASES} if timed else {}


def main(argv: list[str]) -> int:
    from rich.console import Console

    from sparserl_mcore.demo import prepare

    args = _args(argv)
    device = common.device_for(args.smoke)
    env = common.environment(device)
    work = args.work.resolve()
    prepare(work, Console())
    runs: dict[str, tuple[Path, int, dict[str, str]]] = {}
    if device.type == "cuda":
        runs["gpu (1 rank, TP=1, bf16)"] = (_config(work, "gpu", args.steps, 1, "bf16"), 1, {})
    if not args.skip_cpu:
        cpu = _config(work, "cpu", args.steps, args.cpu_nproc, "fp32")
        runs[f"cpu demo ({args.cpu_nproc} ranks, TP={args.cpu_nproc}, fp32)"] = (
            cpu,
            args.cpu_nproc,
            {"CUDA_VISIBLE_DEVICES": ""},
        )
    rows = []
    for name, (config, nproc, extra_env) in runs.items():
        metrics = work / config.stem / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        exit_s = _run(
            config,
            nproc,
            args.steps,
            {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra_env},
        )
        phases = {f"{p}_s": v for p, v in _phases(metrics, args.steps).items()}
        rows.append({"run": name, **phases, "exit_s": exit_s})
    notes = [f"{args.steps} steps, medians of steps 2..{args.steps - 1} (step 1: warm-up; last: eval)"]
    if args.smoke:
        notes.append("SMOKE run: figures mean nothing")
    notes.append("exit s: from the last step's line to the launcher's exit (goal < 10 s)")
    columns = [("run", "run")] + [(f"{p}_s", f"{p} s") for p in PHASES] + [("exit_s", "exit s")]
    common.print_table(f"trainer step on the demo task, {env['device']}", rows, columns)
    print(common.write_record(args.out, "trainer", env, rows, notes))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
