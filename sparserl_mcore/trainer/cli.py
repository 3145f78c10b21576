"""`sparserl train --config X.yaml [key=value ...]`: check the run, then train.

The config is validated, then everything that can be checked before a rank starts
(`trainer.preflight`: layout, model, data, reward, outputs, resume); a problem is one line and exit
code 2, and a run already at train.steps says so and exits 0 without writing anything. Then:
- without `--nproc` this process trains, which is also what torchrun/srun start on every rank
  (`sparserl_mcore.launch.train`, or `launchers/train.py` as a script path; every rank runs the
  checks there);
- with `--nproc N` it starts `torchrun --standalone --nproc_per_node N -m sparserl_mcore.launch.train`
  (`parallel.launch.run_ranks`): rank 0's output stays on the console, every rank's log goes to
  `<telemetry.dir>/logs/rank<R>.log`, and a failure is summarised in one line per distinct error.
The host rank ends the run with a short summary and the paths it wrote.
Exit codes: 0 done (or already complete), 2 refused before start, 3 no rollout engine left,
4 a reward failed (raised, hung past reward.timeout_s, non-finite), 5 train.max_empty_steps steps in
a row trained nothing, 1 any other failure, 128+N stopped by signal N.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sparserl_mcore.cli_args import positive_int

# Set by the launching process for its ranks: the checks ran there already.
CHECKED_ENV = "SPARSERL_RUN_CHECKED"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10"
    )
    parser.add_argument("--nproc", type=positive_int, default=None, help="launch N local ranks with torchrun")
    parser.add_argument(
        "--save-hf", default=None, metavar="DIR", help="export the final policy as HF safetensors"
    )


def run(args: argparse.Namespace) -> int:
    extra = [f"checkpoint.save_hf={args.save_hf}"] if args.save_hf else []
    return main(args.config, [*args.overrides, *extra], nproc=args.nproc)


def _say(line: str, *, error: bool = False) -> None:
    print(f"sparserl train: {line}", file=sys.stderr if error else sys.stdout, flush=True)


def main(config: str, overrides: list[str], *, nproc: int | None = None) -> int:
    """Check, then train here (nproc None) or on `nproc` local ranks; returns the exit code."""
    from sparserl_mcore.config import ConfigError, load_config
    from sparserl_mcore.parallel.config import launch_env
    from sparserl_mcore.trainer.preflight import PreflightError, check_run

    if nproc is not None and nproc < 1:
        _say(f"--nproc {nproc}: must be >= 1", error=True)
        return 2
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        _say(str(exc), error=True)
        return 2
    if os.environ.get(CHECKED_ENV) != "1":
        launch = launch_env()
        try:
            plan = check_run(cfg, world_size=nproc or launch.world_size, probe_servers=launch.rank == 0)
        except PreflightError as exc:
            _say(str(exc), error=True)
            return 2
        for note in plan.notes if launch.rank == 0 else ():
            _say(note)
        if plan.complete:
            return 0
    if nproc is not None:
        return launch_ranks(config, overrides, nproc, log_dir=Path(cfg.telemetry.dir) / "logs")
    return _train_here(cfg)


def _train_here(cfg) -> int:
    from sparserl_mcore.parallel.rank_entry import quiet_optional_backend_warnings

    quiet_optional_backend_warnings()
    from sparserl_mcore.trainer.loop import train

    summary = train(cfg)
    if summary.message:
        _say(summary.message, error=True)
    if summary.metrics_path is not None:  # the host rank
        head, *paths = summary.report()
        _say(head)
        print("\n".join(paths), flush=True)
    _arm_exit_watchdog()
    return summary.exit_code


EXIT_GRACE_S = 30.0


def _arm_exit_watchdog() -> None:
    """The run is over (engines closed, process groups destroyed): if this process is still alive
    EXIT_GRACE_S later, something outside the run holds it (a foreign non-daemon thread, a child
    process, a driver teardown). Then every thread's stack goes to stderr and the process exits
    with status 1, instead of lingering unseen."""
    import faulthandler

    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


def _backend_note() -> str | None:
    import importlib.util

    if importlib.util.find_spec("transformer_engine") or importlib.util.find_spec("apex"):
        return None
    return "without transformer-engine and apex, megatron-core runs its local layers and torch optimizers"


def launch_ranks(config: str, overrides: list[str], nproc: int, *, log_dir: Path) -> int:
    """torchrun on this machine (`run_ranks`), the checks already done; returns the exit code."""
    from sparserl_mcore.parallel.launch import run_ranks

    _say(f"{nproc} ranks; per-rank logs in {log_dir}")
    note = _backend_note()
    if note:
        _say(note)
    argv = ["-m", "sparserl_mcore.launch.train", "--config", config, *overrides]
    result = run_ranks(argv, nproc, log_dir=log_dir, env={CHECKED_ENV: "1"})
    if result.stopped_by and not result.stopped_cleanly:
        _say(
            f"stopped by {result.stopped_by} (exit code {result.returncode}) before the ranks could "
            f"end cleanly with a stop checkpoint; rank logs: {log_dir}",
            error=True,
        )
        return result.returncode
    lines = result.failure_lines()  # none after a clean stop: rank 0 reported it
    if lines:
        _say(f"the run failed (exit code {result.returncode}):", error=True)
        for line in lines:
            print(f"  {line}", file=sys.stderr)
    return result.returncode
