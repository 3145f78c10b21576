"""`sparserl model make-tiny`: a random-weight HF checkpoint (config, safetensors, tokenizer), offline."""

from __future__ import annotations

import argparse
import sys

from sparserl_mcore.ckpt.cli import shard_size
from sparserl_mcore.cli_args import non_negative_int, positive_int

# --dtype spellings -> the torch dtype name make_tiny takes
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight HF checkpoint")
    tiny.add_argument("--arch", required=True, help="qwen2 | qwen3 | llama | qwen3_moe | qwen2_moe")
    tiny.add_argument("--out", required=True, help="output directory (written atomically)")
    tiny.add_argument("--layers", type=positive_int, default=2)
    tiny.add_argument("--hidden", type=positive_int, default=64)
    tiny.add_argument("--heads", type=positive_int, default=4)
    tiny.add_argument("--kv-heads", type=positive_int, default=2)
    tiny.add_argument("--head-dim", type=positive_int, default=None, help="default: hidden // heads")
    tiny.add_argument("--ffn", type=positive_int, default=128, help="MLP intermediate size")
    tiny.add_argument("--vocab", type=positive_int, default=128)
    tiny.add_argument("--tie-embeddings", action="store_true")
    tiny.add_argument("--seed", type=non_negative_int, default=0)
    tiny.add_argument(
        "--dtype", default="float32", help="float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)"
    )
    tiny.add_argument("--experts", type=positive_int, default=4, help="MoE archs: routed experts per layer")
    tiny.add_argument("--top-k", type=positive_int, default=2, help="MoE archs: experts per token")
    tiny.add_argument("--expert-ffn", type=positive_int, default=32, help="MoE archs: expert MLP width")
    tiny.add_argument(
        "--shared-expert-ffn", type=positive_int, default=48, help="qwen2_moe: the shared expert's width"
    )
    tiny.add_argument(
        "--max-shard-size", type=shard_size, default=None, help='e.g. "200KB": write sharded safetensors'
    )
    tiny.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.ckpt.atomic import check_output_dir
    from sparserl_mcore.ckpt.tiny import make_tiny

    try:
        cfg = _config(args)
        check_output_dir(args.out, overwrite=args.overwrite)
    except ValueError as exc:
        print(f"sparserl model make-tiny: {exc}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output: what was written
    out = make_tiny(cfg, args.out, overwrite=args.overwrite)
    print(f"wrote {cfg.arch} tiny checkpoint ({cfg.dtype}) to {out}")
    return 0


def _config(args: argparse.Namespace):
    from sparserl_mcore.ckpt.tiny import TinyModelConfig

    return TinyModelConfig(
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        vocab=args.vocab,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        max_shard_size=args.max_shard_size,
        experts=args.experts,
        top_k=args.top_k,
        expert_ffn=args.expert_ffn,
        shared_expert_ffn=args.shared_expert_ffn,
    )
