"""Atomic training checkpoints: everything a resumed run needs to continue bit-identically.

Layout of `<save_dir>/`:
    latest                  text file naming the newest complete checkpoint (replaced atomically)
    step_00000012/          megatron dist checkpoint (torch_dist) of model + optimizer, whose
                            common part holds the LR scheduler and the loop state (data position,
                            DGG window, synced weight version, ...)
        run.json            step, config, world size, data position (`run_record`: read by the
                            launcher before any rank starts)
        rng_rank00003.safetensors   per-rank RNG streams (torch, CUDA, python, numpy, megatron
                            tracker) as plain tensors + JSON metadata: nothing is unpickled
A checkpoint is written under `.step_N.tmp/` by all ranks and renamed by rank 0 after a barrier,
so a run killed mid-save leaves the previous checkpoint as `latest` (the stale temp dir is removed
on the next save). Model and optimizer are saved through their `sharded_state_dict`, so a
checkpoint taken at one TP/PP layout loads at another (the optimizer state included); the
per-rank RNG streams are restored only at the layout they were saved at.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from safetensors import safe_open
from safetensors.torch import save_file

from sparserl_mcore.trainer.learner import unwrap_model
from sparserl_mcore.trainer.run_record import LATEST, latest_checkpoint, write_record

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]
_OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _sharded_state(model: torch.nn.Module, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    model_sd = unwrap_model(model).sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_META)
    return {"model": model_sd, "optimizer": optim_sd}


def _rng_file(path: Path, rank: int) -> Path:
    return path / f"rng_rank{rank:05d}.safetensors"


def _save_rng(path: Path) -> None:
    """This rank's RNG streams as tensors (safetensors) and scalars (its JSON metadata)."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    tensors = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
    }
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker/{name}"] = state.cpu().contiguous()
    meta = {"python": [py_version, py_gauss], "numpy": [np_name, int(np_pos), int(np_has_gauss), np_gauss]}
    save_file(tensors, str(path), metadata={"scalars": json.dumps(meta)})


def _load_rng(path: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["scalars"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    py_version, py_gauss = meta["python"]
    random.setstate((py_version, tuple(tensors["python"].tolist()), py_gauss))
    np_name, np_pos, np_has_gauss, np_gauss = meta["numpy"]
    np.random.set_state((np_name, tensors["numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    loop_state: dict[str, Any],
    record: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Collective: every rank calls it. Returns the final directory once it is complete.

    `record`: config, world_size and data of `run_record.write_record` (rank 0 writes it)."""
    root = Path(root)
    rank = dist.get_rank()
    final, tmp = _step_dir(root, step), root / f".step_{step:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["loop"] = dict(loop_state)
    dist_checkpointing.save(state, str(tmp))
    _save_rng(_rng_file(tmp, rank))
    dist.barrier()
    if rank == 0:
        write_record(tmp, step=step, **record)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / LATEST)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizer: Any, scheduler: Any, restore_rng: bool = True
) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and (`restore_rng`: the run's layout is the
    saved one) this rank's RNG streams; return the loop state."""
    template = _sharded_state(model, optimizer, is_loading=True)
    state = dist_checkpointing.load(template, str(path))
    unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        rng_file = _rng_file(path, dist.get_rank())
        if not rng_file.is_file():
            raise FileNotFoundError(f"{rng_file} missing: the checkpoint is incomplete")
        _load_rng(rng_file)
    return state["loop"]
