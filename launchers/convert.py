"""torchrun / srun entry for checkpoint conversion; every rank converts only its own shard.

    torchrun --nproc_per_node TP*PP -m launchers.convert hf-to-mcore --hf-dir H --out M --tp T --pp P
    torchrun --nproc_per_node TP*PP -m launchers.convert mcore-to-hf --mcore-dir M --out H2 --tp T --pp P

`--out` must be an existing empty directory; `sparserl convert ...` (tools/convert.py) creates it
under a temp name and renames it only when every rank succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launchers.convert")
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
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    return parser


def _without_init(spec):
    """Skip megatron's random init: every weight is overwritten by the load that follows."""
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, perform_initialization=False))


def hf_to_mcore(args: argparse.Namespace) -> None:
    from model_providers.gpt import build_model, build_spec
    from sparserl_mcore.ckpt.dist_ckpt import HF_SUBDIR, McoreCheckpointMeta, save_dist
    from sparserl_mcore.ckpt.hf_io import HFCheckpoint, copy_hf_metadata, load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    rt = initialize(parallel, seed=0)
    try:
        dtype = args.dtype or HFCheckpoint(args.hf_dir).config_dtype() or "float32"
        spec = _without_init(build_spec(args.hf_dir, parallel, params_dtype=dtype))
        model = build_model(spec, pre_process=rt.is_first_stage, post_process=rt.is_last_stage)
        load_hf_weights(model, layout_for(spec), args.hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
        save_dist(model, args.out)
        if rt.rank == 0:
            McoreCheckpointMeta.from_spec(spec).write(args.out)
            (pathlib.Path(args.out) / HF_SUBDIR).mkdir()
            copy_hf_metadata(args.hf_dir, pathlib.Path(args.out) / HF_SUBDIR)
    finally:
        shutdown()


def mcore_to_hf(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from model_providers.gpt import build_model
    from sparserl_mcore.ckpt.dist_ckpt import HF_SUBDIR, McoreCheckpointMeta, load_dist, spec_for_checkpoint
    from sparserl_mcore.ckpt.hf_io import copy_hf_metadata, export_hf_weights, write_index
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    rt = initialize(parallel, seed=0)
    try:
        meta = McoreCheckpointMeta.read(args.mcore_dir)
        dtype = args.dtype or meta.params_dtype
        spec = _without_init(spec_for_checkpoint(args.mcore_dir, parallel, params_dtype=dtype))
        model = build_model(spec, pre_process=rt.is_first_stage, post_process=rt.is_last_stage)
        load_dist(model, args.mcore_dir)
        weight_map = export_hf_weights(
            model,
            layout_for(spec),
            args.out,
            tp_rank=rt.tp_rank,
            pp_rank=rt.pp_rank,
            tp_group=rt.groups.tp,
            dtype=getattr(torch, dtype),
            max_shard_bytes=args.max_shard_bytes,
        )
        maps: list = [None] * rt.world_size
        dist.all_gather_object(maps, weight_map)
        if rt.rank == 0:
            write_index(args.out, maps)
            src = args.hf_config_dir or pathlib.Path(args.mcore_dir) / HF_SUBDIR
            copy_hf_metadata(src, args.out, dtype=dtype)
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf}[args.direction](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
