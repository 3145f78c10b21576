"""The conversions as collective functions over an initialised runtime (one shard per rank).

`sparserl_mcore.launch.convert` (torchrun / srun entry) and the tests call `hf_to_mcore` / `mcore_to_hf`.
`export_hf` is THE way a megatron model becomes an HF checkpoint (mcore_to_hf and the trainer both
use it): data-parallel rank 0 of each stage writes the weights, global rank 0 the index and
config, in the model's own dtype unless told otherwise (config.json says which). It writes into an
existing empty `out_dir` (`sparserl convert` wraps the launcher with an atomic output directory);
`save_hf` is the same from inside the ranks, into a temp directory renamed when complete. The
conversions build the model without random init (every weight is overwritten by the load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from model_providers.gpt import ModelSpec
    from sparserl_mcore.parallel.runtime import Runtime


def build_for_load(spec: ModelSpec, rt: Runtime):
    """This rank's pipeline stage of `spec` on the runtime's device, without random init (a load
    overwrites every weight): what the conversions, `verify` and the parity checks load into."""
    from model_providers.gpt import build_model

    spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, perform_initialization=False))
    return build_model(
        spec,
        device=rt.device,
        pre_process=rt.is_first_stage,
        post_process=rt.is_last_stage,
        pg_collection=rt.groups,
    )


def hf_to_mcore(
    hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path, rt: Runtime, *, dtype: str | None = None
) -> None:
    """Load HF safetensors at the runtime's TP/PP and save a self-describing dist checkpoint."""
    from model_providers.gpt import build_spec
    from sparserl_mcore.ckpt.dist_ckpt import HF_SUBDIR, McoreCheckpointMeta, save_dist
    from sparserl_mcore.ckpt.hf_io import HFCheckpoint, copy_hf_metadata, load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for

    dtype = dtype or HFCheckpoint(hf_dir).config_dtype() or "float32"
    spec = build_spec(hf_dir, rt.parallel, params_dtype=dtype)
    model = build_for_load(spec, rt)
    load_hf_weights(
        model, layout_for(spec), hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank, ep_rank=rt.ep_rank
    )
    save_dist(model, out_dir)
    if rt.rank == 0:
        McoreCheckpointMeta.from_spec(spec).write(out_dir)
        (pathlib.Path(out_dir) / HF_SUBDIR).mkdir()
        copy_hf_metadata(hf_dir, pathlib.Path(out_dir) / HF_SUBDIR)


def mcore_to_hf(
    mcore_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    rt: Runtime,
    *,
    hf_config_dir: str | pathlib.Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Load a dist checkpoint at the runtime's TP/PP (any the model allows) and export HF files."""
    from sparserl_mcore.ckpt.dist_ckpt import HF_SUBDIR, McoreCheckpointMeta, load_dist, spec_for_checkpoint

    dtype = dtype or McoreCheckpointMeta.read(mcore_dir).params_dtype
    spec = spec_for_checkpoint(mcore_dir, rt.parallel, params_dtype=dtype)
    model = build_for_load(spec, rt)
    load_dist(model, mcore_dir)
    source = hf_config_dir or pathlib.Path(mcore_dir) / HF_SUBDIR
    export_hf(model, spec, rt, out_dir, hf_config_dir=source, dtype=dtype, max_shard_bytes=max_shard_bytes)


def export_hf(
    model: torch.nn.Module,
    spec: ModelSpec,
    rt: Runtime,
    out_dir: str | pathlib.Path,
    *,
    hf_config_dir: str | pathlib.Path,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Collective: write a live (trained) model as an HF checkpoint into existing empty `out_dir`,
    with config and tokenizer files from `hf_config_dir`. `dtype` defaults to the params dtype."""
    import torch
    import torch.distributed as dist

    from sparserl_mcore.ckpt.hf_io import copy_hf_metadata, export_hf_weights, write_index
    from sparserl_mcore.ckpt.layout import layout_for

    dtype = dtype or str(spec.params_dtype).removeprefix("torch.")
    # data-parallel replicas (and DiLoCo islands, once agreed) hold the same weights: one copy of
    # the dense ones (replica 0) and one of the experts (expert-dp rank 0; with expert parallelism
    # the experts of other dp ranks; islands and EP are not combined)
    weight_map = export_hf_weights(
        model,
        layout_for(spec),
        out_dir,
        tp_rank=rt.tp_rank,
        pp_rank=rt.pp_rank,
        tp_group=rt.groups.tp,
        ep_rank=rt.ep_rank,
        expert_group=rt.groups.tp_ep if spec.hf.moe is not None else None,
        dense=rt.replica_rank == 0,
        experts=spec.hf.moe is not None and rt.expert_dp_rank == 0,
        dtype=getattr(torch, dtype),
        max_shard_bytes=max_shard_bytes,
    )
    maps: list = [None] * rt.world_size
    dist.all_gather_object(maps, weight_map)
    if rt.rank == 0:
        write_index(out_dir, maps)
        copy_hf_metadata(hf_config_dir, out_dir, dtype=dtype)
    dist.barrier()


def save_hf(
    model: torch.nn.Module,
    spec: ModelSpec,
    rt: Runtime,
    out: str | pathlib.Path,
    *,
    hf_config_dir: str | pathlib.Path,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> pathlib.Path:
    """Collective: `export_hf` into a temp directory beside `out` that replaces `out` (an earlier
    export included) only once every rank has written, so a crash never leaves a partial `out`."""
    import torch.distributed as dist

    from sparserl_mcore.ckpt.atomic import atomic_output_dir

    writer = atomic_output_dir(out, overwrite=True) if rt.rank == 0 else contextlib.nullcontext()
    with writer as tmp:
        box = [str(tmp) if rt.rank == 0 else ""]
        dist.broadcast_object_list(box, src=0)
        export_hf(
            model, spec, rt, box[0], hf_config_dir=hf_config_dir, dtype=dtype, max_shard_bytes=max_shard_bytes
        )
    dist.barrier()  # `out` is complete on every rank's return
    return pathlib.Path(out)
