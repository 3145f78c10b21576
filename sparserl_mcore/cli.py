"""The `sparserl` console script.

Each command lives in its own module, imported only when that command runs, so `sparserl --help`
stays fast and never imports megatron-core. A command module exposes
`add_arguments(parser)` and `run(args) -> int`.

What a user sees when something goes wrong is one line and a non-zero exit code: a bad command
line (`cli_args.ArgumentParser`, exit 2), a bad input (each command's own checks), a file the
system refuses (`OSError` with a path: exit 1). Only a bug shows as more: one line naming the
file that holds its traceback (exit 1). Ctrl-C exits 130.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import traceback

from sparserl_mcore.cli_args import ArgumentParser

# name -> (module, one-line help). Exhaustive: a new command is added here.
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("sparserl_mcore.ckpt.model_cli", "make tiny random-weight HF checkpoints (tests, demos)"),
    "convert": (
        "sparserl_mcore.ckpt.cli",
        "HF safetensors <-> Megatron dist checkpoints, and logit parity checks",
    ),
    "sync": ("sparserl_mcore.sync.cli", "sparse BF16 weight patches: diff, apply, inspect, bench"),
    "serve": (
        "sparserl_mcore.rollout.http.cli",
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


def _top_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            print(
                f"sparserl: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr
            )
            return 2
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = ArgumentParser(prog=f"sparserl {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # --help (0) or a bad command line, already said in one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    return _run(name, module, args)


def _run(name: str, module, args) -> int:
    """The command, with what escapes it turned into one line (see the module docstring)."""
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"sparserl {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # our own output was cut (`| head`): nothing left to tell
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        if exc.filename is None:
            return _bug(name, exc)
        print(f"sparserl {name}: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        return _bug(name, exc)


def _bug(name: str, exc: BaseException) -> int:
    """An exception no check turned into a message is a bug: its traceback goes to a file, and the
    user gets one line naming it."""
    fd, path = tempfile.mkstemp(prefix=f"sparserl-{name}-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        traceback.print_exception(exc, file=log)
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    print(
        f"sparserl {name}: internal error ({type(exc).__name__}: {first}); this is a bug, "
        f"please report it with the traceback in {path}",
        file=sys.stderr,
    )
    return 1
