"""`sparserl train --config X.yaml [key=value ...]`: validate the config, then train.

Without `--nproc` the command trains in this process, which is what torchrun/srun start on every
rank (`sparserl_mcore.launch.train`, also `launchers/train.py` as a script path). With `--nproc N` it
validates the config once here, then starts `torchrun --standalone --nproc_per_node N -m
sparserl_mcore.launch.train ...`
itself and streams its output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys


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
    if args.nproc is not None:
        return launch(args.config, _overrides(args), args.nproc)
    from sparserl_mcore.trainer.loop import train

    summary = train(cfg)
    if summary.message:
        print(f"sparserl train: {summary.message}", file=sys.stderr)
    return summary.exit_code


def launch(config: str, overrides: list[str], nproc: int) -> int:
    """torchrun on this machine, output streamed (not captured: the run can be long)."""
    from sparserl_mcore.parallel.launch import torchrun_command

    entry = ["-m", "sparserl_mcore.launch.train"]
    return subprocess.call(torchrun_command([*entry, "--config", config, *overrides], nproc))
