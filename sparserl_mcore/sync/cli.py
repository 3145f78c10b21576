"""`sparserl sync diff | apply | inspect | bench`: sparse BF16 patches between HF checkpoints.

A and B are safetensors files or HF directories. `apply` validates the patch against A (names,
shapes, digests of every reconstructed tensor and of the whole model) and writes C atomically;
C's tensors are bit-identical to B's or nothing is written. Heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparserl_mcore.cli_args import non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    diff = sub.add_parser("diff", help="write the patch taking --old to --new")
    diff.add_argument("--old", type=Path, required=True, help="base weights (safetensors file or HF dir)")
    diff.add_argument("--new", type=Path, required=True, help="updated weights, same names and shapes")
    diff.add_argument("--out", type=Path, required=True, help="patch file to write")
    diff.add_argument("--version", type=positive_int, default=1, help="version of --new (default 1)")
    diff.add_argument(
        "--base-version", type=non_negative_int, default=None, help="version of --old (default version-1)"
    )
    diff.add_argument(
        "--anchor-version", type=non_negative_int, default=0, help="last full anchor (default 0)"
    )
    diff.add_argument("--encoding", default="sub", help="value encoding: overwrite, xor or sub (default)")
    diff.add_argument(
        "--zstd-level", type=non_negative_int, default=1, help="zstd level 1..22, 0 for no zstd (default 1)"
    )

    apply = sub.add_parser("apply", help="apply a patch to --base and write --out")
    apply.add_argument("--base", type=Path, required=True, help="weights the patch was made against")
    apply.add_argument("--patch", type=Path, required=True)
    apply.add_argument("--out", type=Path, required=True, help="output file / new directory (atomic)")
    apply.add_argument(
        "--base-version",
        type=non_negative_int,
        default=None,
        help="version --base holds (default: the patch's base)",
    )

    inspect = sub.add_parser("inspect", help="print a patch's header and statistics as JSON")
    inspect.add_argument("patch", type=Path)
    inspect.add_argument("--no-tensors", action="store_true", help="omit the per-tensor list")

    bench = sub.add_parser("bench", help="sparse sync vs dense safetensors on real Adam steps")
    bench.add_argument("--full", action="store_true", help="Qwen2.5-0.5B shape, 3 steps per lr (~10 GB RAM)")
    bench.add_argument("--hf-dir", type=Path, default=None, help="load real weights + config from here")
    bench.add_argument(
        "--lrs", type=positive_float, nargs="+", default=[1e-6, 3e-6], help="Adam learning rates"
    )
    bench.add_argument(
        "--steps", type=positive_int, default=None, help="Adam steps per lr (default 3 full, 2 quick)"
    )
    bench.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence of the LM loss")
    bench.add_argument("--batch", type=positive_int, default=2, help="sequences per step")
    bench.add_argument("--encodings", nargs="+", default=["sub", "xor", "overwrite"], help="value encodings")
    bench.add_argument(
        "--position-models", nargs="+", default=["base"], help="position models (base, plain), side by side"
    )
    bench.add_argument(
        "--mid-training", action="store_true", help="fp32 master anywhere in its bf16 rounding interval"
    )
    bench.add_argument(
        "--repeat", type=positive_int, default=3, help="timed runs per measurement, fastest kept"
    )
    bench.add_argument("--json", type=Path, default=None, help="also write the per-step rows here")


def _diff(args: argparse.Namespace) -> int:
    from sparserl_mcore.sync.codec import CodecConfig, encode_patch, inspect_patch
    from sparserl_mcore.sync.diff import make_patch
    from sparserl_mcore.sync.hf_files import load_state
    from sparserl_mcore.sync.transport_dir import atomic_write_bytes

    config = CodecConfig(encoding=args.encoding, zstd_level=args.zstd_level or None)
    _check_out(args.out, directory=False)
    base_version = args.version - 1 if args.base_version is None else args.base_version
    patch = make_patch(
        load_state(args.old),
        load_state(args.new),
        version=args.version,
        base_version=base_version,
        anchor_version=args.anchor_version,
    )
    data = encode_patch(patch, config)
    atomic_write_bytes(args.out, data)
    info = inspect_patch(data)
    info.pop("tensors")
    print(json.dumps(info, indent=2))
    return 0


def _apply(args: argparse.Namespace) -> int:
    from sparserl_mcore.sync.apply import apply_patch
    from sparserl_mcore.sync.codec import decode_patch
    from sparserl_mcore.sync.hf_files import load_state, save_state_like

    _check_out(args.out, directory=not args.base.is_file())
    data = args.patch.read_bytes()
    state = load_state(args.base)
    version = decode_patch(data).base_version if args.base_version is None else args.base_version
    result = apply_patch(state, data, version=version)
    save_state_like(state, args.out, like=args.base)
    print(
        json.dumps(
            {"version": result.version, "changed_elements": result.changed_elements, "out": str(args.out)}
        )
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from sparserl_mcore.sync.codec import inspect_patch

    info = inspect_patch(args.patch.read_bytes())
    if args.no_tensors:
        info.pop("tensors")
    print(json.dumps(info, indent=2))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from sparserl_mcore.sync.bench import run_bench

    if args.hf_dir is not None and not args.hf_dir.is_dir():
        raise ValueError(f"--hf-dir {args.hf_dir}: no such directory")
    if args.json is not None:
        _check_out(args.json, directory=False)

    return run_bench(args)


def _check_out(out: Path, *, directory: bool) -> None:
    """Refuse an output that cannot be written before any work is done."""
    from sparserl_mcore.ckpt.atomic import output_problem

    problem = output_problem(out, directory=directory)
    if problem:
        raise ValueError(f"--out {problem}")


ACTIONS = {"diff": _diff, "apply": _apply, "inspect": _inspect, "bench": _bench}


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.sync.codec import PatchError

    try:
        return ACTIONS[args.action](args)
    except (PatchError, ValueError) as exc:
        print(f"sparserl sync {args.action}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a missing file, a directory where a file was expected, ...
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"sparserl sync {args.action}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
