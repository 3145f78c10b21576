"""Atomic training checkpoints: everything a resumed run needs to continue bit-identically.

Layout of `<save_dir>/`:
    latest                  text file naming the newest complete checkpoint (replaced atomically)
    step_00000012/          megatron dist checkpoint (torch_dist) of model + optimizer, whose
                            common part holds the LR scheduler and the loop state (data position,
                            DGG window, synced weight version, ...)
        rng_rank00003.pt    per-rank RNG streams (torch, CUDA, python, numpy, megatron tracker)
A checkpoint is written under `.step_N.tmp/` by all ranks and renamed by rank 0 after a barrier,
so a run killed mid-save leaves the previous checkpoint as `latest` (the stale temp dir is removed
on the next save). Model and optimizer are saved through their `sharded_state_dict`, so a
checkpoint taken at one TP/PP layout loads at another (the optimizer state included).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from sparserl_mcore.trainer.learner import unwrap_model

LATEST = "latest"
_OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _sharded_state(model: torch.nn.Module, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    model_sd = unwrap_model(model).sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_META)
    return {"model": model_sd, "optimizer": optim_sd}


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    loop_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Collective: every rank calls it. Returns the final directory once it is complete."""
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
    torch.save(_rng_state(), tmp / f"rng_rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
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


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none yet."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{marker} names {path}, which is not a complete dist checkpoint")
    return path


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and this rank's RNG; return the loop state."""
    template = _sharded_state(model, optimizer, is_loading=True)
    state = dist_checkpointing.load(template, str(path))
    unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} missing: the checkpoint was written by a different world size")
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return state["loop"]
