"""`sparserl convert`: HF safetensors <-> Megatron dist checkpoints, and logit parity checks.

    sparserl convert hf-to-mcore --hf-dir H --out M [--tp T --pp P --ep E --etp ET]
    sparserl convert mcore-to-hf --mcore-dir M --out H2 [--hf-config-dir H] [--tp T --pp P --ep E]
    sparserl convert verify ...            (ckpt/verify_cli.py: megatron vs HF transformers logits)

Conversions check the input in this process first (config, TP/PP, tensor names and shapes: errors
name the tensor or field), then run the layout's fewest ranks (TP*PP, or the least common
multiple of TP*PP and ETP*EP*PP for MoE models) with torchrun (`sparserl_mcore.launch.convert`) writing into a
temp directory beside `--out`, renamed only when every rank succeeded.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

from sparserl_mcore.cli_args import positive_float, positive_int
from sparserl_mcore.parallel.config import ParallelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint (torch_dist)")
    to_mcore.add_argument(
        "--hf-dir", required=True, help="HF checkpoint directory (config.json, safetensors)"
    )
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF sharded safetensors")
    to_hf.add_argument("--mcore-dir", required=True, help="directory written by hf-to-mcore")
    to_hf.add_argument(
        "--hf-config-dir", default=None, help="config.json + tokenizer source (default: the copy stored in M)"
    )
    to_hf.add_argument(
        "--max-shard-size", type=shard_size, default="2GB", help="safetensors file size limit, e.g. 500MB"
    )
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory (written atomically)")
        p.add_argument(
            "--tp", type=positive_int, default=None, help="tensor parallel ranks (default: 1 / as saved)"
        )
        p.add_argument(
            "--pp", type=positive_int, default=None, help="pipeline parallel ranks (default: 1 / as saved)"
        )
        p.add_argument(
            "--ep", type=positive_int, default=None, help="MoE: expert parallel ranks (default: 1 / as saved)"
        )
        p.add_argument(
            "--etp", type=positive_int, default=None, help="MoE: expert tensor parallel ranks (default: TP)"
        )
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
        p.add_argument(
            "--timeout", type=positive_float, default=None, help="seconds before the ranks are killed"
        )
    verify = sub.add_parser("verify", help="compare megatron logits with HF transformers")
    importlib.import_module("sparserl_mcore.ckpt.verify_cli").add_arguments(
        verify
    )  # cheap: no torch at import time


def run(args: argparse.Namespace) -> int:
    if args.action == "verify":
        return int(importlib.import_module("sparserl_mcore.ckpt.verify_cli").run(args) or 0)
    from sparserl_mcore.parallel.launch import RanksFailed

    try:
        argv, nproc = _prepare(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"sparserl convert {args.action}: error: {exc}", file=sys.stderr)
        return 2
    try:
        _launch(argv, nproc, args)
    except RanksFailed as exc:
        print(
            f"sparserl convert {args.action}: error: the conversion ranks failed; nothing was written "
            f"to {args.out}",
            file=sys.stderr,
        )
        print(str(exc), file=sys.stderr)
        return exc.result.returncode
    print(f"wrote {args.out}")
    return 0


def _prepare(args: argparse.Namespace) -> tuple[list[str], int]:
    """Validate everything that can be checked without ranks; return the launcher argv and nproc."""
    from sparserl_mcore.ckpt.atomic import check_output_dir
    from sparserl_mcore.ckpt.preflight import check_mcore_checkpoint

    check_output_dir(args.out, overwrite=args.overwrite)
    if args.dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"--dtype {args.dtype!r}; choose float32 or bfloat16")
    if args.action == "hf-to-mcore":
        par = ParallelConfig(
            tensor_model_parallel_size=args.tp or 1,
            pipeline_model_parallel_size=args.pp or 1,
            expert_model_parallel_size=args.ep or 1,
            expert_tensor_parallel_size=args.etp,
        )
        preflight_hf(args.hf_dir, par, args.dtype)
        argv = ["hf-to-mcore", "--hf-dir", str(args.hf_dir)]
    else:
        par = check_mcore_checkpoint(
            args.mcore_dir, args.tp, args.pp, args.hf_config_dir, ep=args.ep, etp=args.etp
        )
        argv = ["mcore-to-hf", "--mcore-dir", str(args.mcore_dir)]
        argv += ["--max-shard-bytes", str(parse_size(args.max_shard_size))]
        if args.hf_config_dir:
            argv += ["--hf-config-dir", str(args.hf_config_dir)]
    argv += par.rank_flags()
    if args.dtype:
        argv += ["--dtype", args.dtype]
    return argv, par.min_world_size


def _launch(argv: list[str], nproc: int, args: argparse.Namespace) -> None:
    """The ranks write into a temp dir beside --out (renamed on success); their logs go to a temp
    dir that is kept, and named, when they fail."""
    import shutil
    import tempfile

    from sparserl_mcore.ckpt.atomic import atomic_output_dir
    from sparserl_mcore.parallel.launch import RanksFailed, run_ranks

    logs = tempfile.mkdtemp(prefix="sparserl-convert-logs-")
    with atomic_output_dir(args.out, overwrite=args.overwrite) as tmp:
        argv = ["-m", "sparserl_mcore.launch.convert", *argv, "--out", str(tmp)]
        result = run_ranks(argv, nproc, log_dir=logs, timeout=args.timeout)
        if result.returncode:
            raise RanksFailed(result)
    shutil.rmtree(logs, ignore_errors=True)


def preflight_hf(hf_dir: str | pathlib.Path, par: ParallelConfig, dtype: str | None = None) -> None:
    """`check_hf_checkpoint` at layout `par`, and a dtype megatron can train in."""
    from sparserl_mcore.ckpt.hf_io import HFCheckpoint
    from sparserl_mcore.ckpt.preflight import check_hf_checkpoint

    check_hf_checkpoint(hf_dir, parallel=par)
    stored = HFCheckpoint(hf_dir).config_dtype()
    if (dtype or stored or "float32") not in ("float32", "bfloat16"):
        raise ValueError(f"{hf_dir} stores dtype {stored!r}; convert with --dtype float32 or bfloat16")


def shard_size(text: str) -> str:
    """argparse type of the --max-shard-size flags: the text, once `parse_size` reads it."""
    try:
        parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use a size like 2GB, 500MB or 100KB") from None
    return text


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '100KB' / '1234' -> bytes (powers of 1000, as transformers' max_shard_size)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"--max-shard-size {text!r}: use a size like 2GB, 500MB or 100KB")
