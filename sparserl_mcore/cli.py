"""The `sparserl` console script.

Each command lives in its own module, imported only when that command runs, so `sparserl --help`
stays fast and never imports megatron-core. A command module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Exhaustive: a new command is added here.
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("sparserl_mcore.ckpt.model_cli", "make tiny random-weight HF checkpoints (tests, demos)"),
    "convert": (
        "sparserl_mcore.ckpt.cli",
        "HF safetensors <-> Megatron dist checkpoints, and logit parity checks",
    ),
    "sync": ("sparserl_mcore.sync.cli", "sparse BF16 weight patches: diff, apply, inspect, bench"),
    "serve": (
        "sparserl_mcore.rollout.cli",
        "run the embedded rollout engine behind an SGLang-style HTTP API",
    ),
    "sglang-serve": (
        "sparserl_mcore.sglang.cli",
        "start SGLang with the sparse-sync weight loader and the KV-compression plugin",
    ),
    "train": ("sparserl_mcore.trainer.cli", "RL training from a YAML config with dotted overrides"),
    "slurm": ("sparserl_mcore.slurm.cli", "render (and submit) the sbatch job of a run config"),
    "demo": ("sparserl_mcore.demo", "the small end-to-end CPU run behind `make demo`"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"sparserl {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)
