"""torchrun / srun entry for checkpoint conversion; every rank converts only its own shard.

    torchrun --nproc_per_node TP*PP -m sparserl_mcore.launch.convert hf-to-mcore --hf-dir H --out M \
        --tp T --pp P
    torchrun --nproc_per_node TP*PP -m sparserl_mcore.launch.convert mcore-to-hf --mcore-dir M --out H2 \
        --tp T --pp P

(or `launchers/convert.py` as the script path).

`--out` must be an existing empty directory; `sparserl convert ...` (ckpt/cli.py) creates it
under a temp name and renames it only when every rank succeeded.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparserl_mcore.launch.convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore")
    to_mcore.add_argument("--hf-dir", required=True)
    to_hf = sub.add_parser("mcore-to-hf")
    to_hf.add_argument("--mcore-dir", required=True)
    to_hf.add_argument("--hf-config-dir", default=None, help="config/tokenizer source (default: M/hf)")
    to_hf.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3)
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True)
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--etp", type=int, default=None)
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from sparserl_mcore.ckpt import convert
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
    )
    rt = initialize(parallel, seed=0)
    try:
        if args.direction == "hf-to-mcore":
            convert.hf_to_mcore(args.hf_dir, args.out, rt, dtype=args.dtype)
        else:
            convert.mcore_to_hf(
                args.mcore_dir,
                args.out,
                rt,
                hf_config_dir=args.hf_config_dir,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_bytes,
            )
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    from sparserl_mcore.parallel.rank_entry import rank_main

    sys.exit(rank_main(main))
