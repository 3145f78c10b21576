"""`sparserl convert verify`: do a Megatron checkpoint's logits match HF transformers?

Launches TP*PP local ranks (torchrun; NCCL with one GPU per rank, gloo on CPU or with `--cpu`)
running `sparserl_mcore.launch.verify`, which loads the
dist checkpoint at the requested layout and compares fp32 logits on fixed prompts against HF
transformers on the HF checkpoint. The last printed line is the maximum absolute and relative
difference; the exit status is 1 when the relative difference exceeds the tolerance.
Imports nothing heavy at import time (the CLI stays fast).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint (the reference)")
    parser.add_argument("--mcore-dir", required=True, help="Megatron dist checkpoint to verify")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size to load at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size to load at")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="max allowed |mcore - hf| / max|hf| over real-token logits (default 1e-5, fp32)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run the ranks on CPU over gloo even where GPUs are visible"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.parallel.launch import LaunchError, launch_local

    for flag, path in (("--hf-dir", args.hf_dir), ("--mcore-dir", args.mcore_dir)):
        if not pathlib.Path(path).is_dir():
            print(f"sparserl convert verify: {flag} {path} is not a directory", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="sparserl-verify-") as tmp:
        result_path = pathlib.Path(tmp) / "result.json"
        argv = [
            "-m",
            "sparserl_mcore.launch.verify",
            "--hf-dir",
            str(args.hf_dir),
            "--mcore-dir",
            str(args.mcore_dir),
        ]
        argv += ["--tp", str(args.tp), "--pp", str(args.pp), "--result", str(result_path)]
        try:
            env = {"CUDA_VISIBLE_DEVICES": ""} if args.cpu else None
            launch_local(argv, args.tp * args.pp, env=env, timeout=args.timeout)
        except LaunchError as exc:
            print(str(exc)[-8000:], file=sys.stderr)
            print("sparserl convert verify: the ranks failed (output above); nothing was compared")
            return 1
        result = json.loads(result_path.read_text())
    ok = result["max_rel_diff"] <= args.tolerance
    print(
        f"verified {result['arch']} at TP={result['tp']} PP={result['pp']} against HF transformers: "
        f"{result['prompts']} prompts, {result['tokens']} token positions, fp32, tolerance {args.tolerance:g}"
    )
    print(
        f"max_abs_diff={result['max_abs_diff']:.3e} max_rel_diff={result['max_rel_diff']:.3e} "
        f"{'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1
