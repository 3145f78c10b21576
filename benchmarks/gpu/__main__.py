"""`python -m benchmarks.gpu` (what `make gpu-check` runs after the GPU tests): every GPU benchmark
in its own process (fresh device memory; one failing does not stop the others), then
OUT/summary.md: the machine record and one table per benchmark, ready for docs/benchmarks.md.

    python -m benchmarks.gpu [--only learner,logprob,engine,sync,trainer] [--out gpu-results] [--smoke]
                             [--timeout-s 600] [--summary-only]

The summary covers every benchmark with a result in OUT, so separate `--only` runs into one OUT
(tools/gpu_check.sh runs the demo-step benchmark beside the tests) add up to one report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("learner", "logprob", "engine", "sync", "trainer")


def _summary(out: Path) -> Path:
    lines = ["# GPU benchmarks", ""]
    env_written = False
    for name in BENCHMARKS:
        path = out / f"{name}.json"
        if not path.is_file():
            lines += [f"## {name}", "", "no result (the benchmark failed; see its output)", ""]
            continue
        record = json.loads(path.read_text())
        if not env_written:
            lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in record["environment"].items()), ""]
            env_written = True
        lines += [f"## {name}", "", *(f"- {n}" for n in record["notes"]), ""]
        rows = record["rows"]
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
        lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)


def _run(cmd: list[str], timeout_s: float) -> int:
    """The benchmark's exit status; past `timeout_s` its whole process group (torchrun's workers
    too) is killed and -9 returned, so one stuck benchmark does not eat the others' time."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{cmd[2]}: killed at its {timeout_s:.0f} s limit", flush=True)
        return -9


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHMARKS))
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device (no figures)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for each benchmark's process")
    p.add_argument("--summary-only", action="store_true", help="rewrite OUT/summary.md, run nothing")
    args = p.parse_args(argv)
    if args.summary_only:
        print(f"summary: {_summary(args.out)}")
        return 0
    names = args.only.split(",")
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        p.error(f"--only: unknown {unknown}; known: {', '.join(BENCHMARKS)}")
    failed = []
    for name in names:
        cmd = [sys.executable, "-m", f"benchmarks.gpu.{name}", "--out", str(args.out)]
        print(f"\n=== {' '.join(cmd[2:])}{' --smoke' if args.smoke else ''} ===", flush=True)
        if _run(cmd + (["--smoke"] if args.smoke else []), args.timeout_s) != 0:
            failed.append(name)
    print(f"\nsummary: {_summary(args.out)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
