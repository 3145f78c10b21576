"""`sparserl train --config X.yaml [key=value ...]`: validate the config, then train.

Without `--nproc` the command trains in this process, which is what torchrun/srun start on every
rank (`launchers/train.py` is the same entry as a script path). With `--nproc N` it validates the
config once here, then starts `torchrun --standalone --nproc_per_node N launchers/train.py ...`
itself and streams its output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10"
    )
    parser.add_argument("--nproc", type=int, default=None, help="launch N local ranks with torchrun")
    parser.add_argument(
        "--save-hf", default=None, metavar="DIR", help="export the final policy as HF safetensors"
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [f"checkpoint.save_hf={args.save_hf}"] if args.save_hf else []
    return [*args.overrides, *extra]


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"sparserl train: {exc}", file=sys.stderr)
        return 2
    problem = resume_problem(cfg, args.nproc)
    if problem:
        print(f"sparserl train: {problem}", file=sys.stderr)
        return 2
    if args.nproc is not None:
        return launch(args.config, _overrides(args), args.nproc)
    from sparserl_mcore.trainer.loop import train

    summary = train(cfg)
    if summary.message:
        print(f"sparserl train: {summary.message}", file=sys.stderr)
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


def resume_problem(cfg, nproc: int | None) -> str | None:
    """Why this run cannot resume its checkpoint directory's latest checkpoint (checked before any
    rank starts); None when it can or when there is nothing to resume."""
    from sparserl_mcore.trainer.run_layout import check_resumable, latest_checkpoint, requested_layout

    path = latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir and cfg.checkpoint.resume else None
    if path is None:
        return None
    world = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return check_resumable(path, requested_layout(cfg, world))


def launch(config: str, overrides: list[str], nproc: int) -> int:
    """torchrun on this machine, output streamed (not captured: the run can be long)."""
    import launchers.train
    from sparserl_mcore.parallel.launch import torchrun_command

    script = str(Path(launchers.train.__file__).resolve())
    return subprocess.call(torchrun_command([script, "--config", config, *overrides], nproc))
