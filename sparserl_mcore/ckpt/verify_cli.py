"""`sparserl convert verify`: do a Megatron checkpoint's logits match HF transformers?

Launches TP*PP local ranks (torchrun; NCCL with one GPU per rank, gloo on CPU or with `--cpu`)
running `sparserl_mcore.launch.verify`, which loads the
dist checkpoint at the requested layout and compares fp32 logits on fixed prompts against HF
transformers on the HF checkpoint. The last printed line is the maximum absolute and relative
difference. Exit status: 0 the logits match; 1 they do not (the line starts with "MISMATCH");
2 the input was refused before any rank started (missing directory, a layout the model cannot
take, a checkpoint that does not match --hf-dir); 3 the ranks failed (one line per error, with the
log that holds its traceback). Imports nothing heavy at import time (the CLI stays fast).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

from sparserl_mcore.cli_args import positive_float, positive_int

EXIT_MATCH, EXIT_MISMATCH, EXIT_REFUSED, EXIT_RANKS_FAILED = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint (the reference)")
    parser.add_argument("--mcore-dir", required=True, help="Megatron dist checkpoint to verify")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor_model_parallel_size to load at")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline_model_parallel_size to load at")
    parser.add_argument("--ep", type=positive_int, default=1, help="MoE: expert parallel size to load at")
    parser.add_argument(
        "--etp", type=positive_int, default=None, help="MoE: expert_tensor_parallel_size (default: TP)"
    )
    parser.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-5,
        help="max allowed |mcore - hf| / max|hf| over real-token logits (default 1e-5, fp32)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run the ranks on CPU over gloo even where GPUs are visible"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=1800.0, help="seconds before the ranks are killed"
    )


def preflight(args: argparse.Namespace):
    """H a complete checkpoint with a tokenizer; M readable, converted from H's model, and loadable
    at (--tp, --pp, --ep, --etp); returns that layout. Raises ValueError (or OSError) naming the
    problem."""
    from sparserl_mcore.ckpt.preflight import check_hf_checkpoint, check_mcore_checkpoint

    check_hf_checkpoint(args.hf_dir, label="--hf-dir", tokenizer=True)
    if not pathlib.Path(args.mcore_dir).is_dir():
        raise ValueError(f"--mcore-dir {args.mcore_dir}: no such directory")
    return check_mcore_checkpoint(
        args.mcore_dir,
        args.tp,
        args.pp,
        hf_config_dir=args.hf_dir,
        label="--hf-dir",
        ep=args.ep,
        etp=args.etp,
    )


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.parallel.launch import run_ranks

    try:
        par = preflight(args)
    except (ValueError, OSError) as exc:
        print(f"sparserl convert verify: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    logs = pathlib.Path(tempfile.mkdtemp(prefix="sparserl-verify-logs-"))
    result_path = logs / "result.json"
    argv = [
        "-m",
        "sparserl_mcore.launch.verify",
        "--hf-dir",
        str(args.hf_dir),
        "--mcore-dir",
        str(args.mcore_dir),
    ]
    argv += [*par.rank_flags(), "--result", str(result_path)]
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.cpu else None
    ranks = run_ranks(argv, par.min_world_size, log_dir=logs, env=env, timeout=args.timeout)
    if ranks.returncode:
        print("sparserl convert verify: the ranks failed; nothing was compared", file=sys.stderr)
        for line in ranks.failure_lines():
            print(f"  {line}", file=sys.stderr)
        return ranks.returncode if ranks.stopped_by else EXIT_RANKS_FAILED
    result = json.loads(result_path.read_text())
    shutil.rmtree(logs, ignore_errors=True)
    return report(result, args.tolerance)


def report(result: dict, tolerance: float) -> int:
    """Print the comparison; the last line holds the max abs/rel difference."""
    ok = result["max_rel_diff"] <= tolerance
    what = (
        f"{result['arch']} at TP={result['tp']} PP={result['pp']}"
        + (f" EP={result['ep']}" if result.get("ep", 1) > 1 else "")
        + " against HF transformers: "
        f"{result['prompts']} prompts, {result['tokens']} token positions, fp32, tolerance {tolerance:g}"
    )
    print(f"verified {what}" if ok else f"MISMATCH: {what}")
    print(
        f"max_abs_diff={result['max_abs_diff']:.3e} max_rel_diff={result['max_rel_diff']:.3e} "
        f"{'OK' if ok else 'FAIL'}"
    )
    return EXIT_MATCH if ok else EXIT_MISMATCH
