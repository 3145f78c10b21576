"""Atomic training checkpoints: everything a resumed run needs to continue bit-identically.

Layout of `<save_dir>/`:
    latest                  text file naming the newest complete checkpoint (replaced atomically)
    step_00000012/          megatron dist checkpoint (torch_dist) of model + optimizer, whose
                            common part holds the LR scheduler and the loop state (data position,
                            DGG window, synced weight version, ...)
        run.json            step, config, world size, the layout it was saved at, data position
                            (`run_record`: read by the launcher before any rank starts)
        rng_rank00003.safetensors   per-rank RNG streams (torch, CUDA, python, numpy, megatron
                            tracker) as plain tensors + JSON metadata: nothing is unpickled
A checkpoint is written under `.step_N.tmp/` by all ranks and renamed by rank 0 after a barrier,
so a run killed mid-save leaves the previous checkpoint as `latest` (the stale temp dir is removed
on the next save). Model and optimizer are saved through their `sharded_state_dict` (the
distributed optimizer as `fully_reshardable`: fp32 master weights and Adam moments in model
space), so a checkpoint taken at one TP/PP/DP layout and params dtype loads at another; what
cannot change is refused before loading (`run_layout.resume_problem`). At the same layout every
rank gets its RNG streams back (a bit-identical continuation); at another they are re-seeded from
(seed, step), since no rank of the new layout plays an old rank's role.

With DiLoCo islands (`IslandState`) each island's model and inner optimizer differ between outer
steps, so they are saved under `island<i>.` keys (replicas counted inside the island), and beside
them the outer state (`diloco.outer.OuterStep.sharded_state_dict`): the anchor and outer momentum
once (island 0's), each island's residual; its counters ride in the loop state. Such a
checkpoint resumes at the layout it was saved at (`run_layout.resume_problem`).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from safetensors import safe_open
from safetensors.torch import save_file

from sparserl_mcore.ckpt.atomic import file_mode
from sparserl_mcore.loss.lm_head_grad import leaf_optimizers
from sparserl_mcore.parallel.rank_entry import helper_process_init
from sparserl_mcore.parallel.runtime import seed_everything
from sparserl_mcore.trainer.learner import unwrap_model
from sparserl_mcore.trainer.run_layout import RunLayout
from sparserl_mcore.trainer.run_record import (
    LATEST,
    check_resumable,
    latest_checkpoint,
    read_saved_run,
    rng_file,
    write_record,
)

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint", "start_checkpoint_writer"]
_OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


@dataclass(frozen=True)
class IslandState:
    """This rank's island (DiLoCo) as the checkpoint needs it: which island, its place in it, the
    island's data-parallel group (replica ids of the per-island model and optimizer state) and
    the outer step whose state is saved beside them."""

    island: int
    position: int  # rank inside the island: the key of its outer-state shard
    dp_cp_group: dist.ProcessGroup
    outer: Any  # diloco.outer.OuterStep


def _sharded_state(
    model: torch.nn.Module,
    optimizer: Any,
    *,
    is_loading: bool,
    islands: IslandState | None = None,
    saved_keys: set[str] | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds of model and optimizer (and with islands, of the outer step; when
    loading, only the outer-state keys in `saved_keys`: a dense-mode checkpoint has no residual)."""
    if islands is None:
        model_sd = unwrap_model(model).sharded_state_dict()
    else:
        model_sd = unwrap_model(model).sharded_state_dict(metadata={"dp_cp_group": islands.dp_cp_group})
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_META)
    state = {"model": model_sd, "optimizer": optim_sd}
    if islands is not None:
        add_prefix_for_sharding(state, f"island{islands.island}.")
        outer = islands.outer.sharded_state_dict(islands.position)
        state["diloco"] = {k: t for k, t in outer.items() if saved_keys is None or t.key in saved_keys}
    return state


def _materialize_adam_state(optimizer: Any) -> None:
    """Give every parameter of a torch Adam that has not stepped yet its state: step 0, zero moments.

    Megatron saves the per-parameter state that exists, so a checkpoint taken before the first
    optimizer step (every update so far filtered or skipped, a stop signal at step 0) would lack it
    and fail to load (torch's Adam needs `step` beside the moments megatron's loader creates).
    Zero moments at step 0 are exactly what Adam starts from, so the next step is unchanged.
    """
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if state:
                    continue
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


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
    path.chmod(file_mode())  # safetensors writes 0600; the checkpoint's other files follow the umask


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


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".step_{step:08d}.tmp"


def _no_partial_on_error(save: Callable[..., Path]) -> Callable[..., Path]:
    """A save that raises (a full disk, a rank that died) removes its temp directory on rank 0:
    nothing partial is left beside the checkpoints, and `latest` still names the last good one."""

    @functools.wraps(save)
    def guarded(root: str | os.PathLike, step: int, **kwargs: Any) -> Path:
        try:
            return save(root, step, **kwargs)
        except BaseException:
            if dist.get_rank() == 0:
                shutil.rmtree(_tmp_dir(Path(root), step), ignore_errors=True)
            raise

    return guarded


@_no_partial_on_error
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
    islands: IslandState | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final directory once it is complete.

    `record`: config, world_size, data and layout of `run_record.write_record` (rank 0 writes it).
    `islands`: this rank's DiLoCo island (per-island model / optimizer keys, the outer state)."""
    root = Path(root)
    rank = dist.get_rank()
    final, tmp = _step_dir(root, step), _tmp_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _materialize_adam_state(optimizer)
    state = _sharded_state(model, optimizer, is_loading=False, islands=islands)
    state["scheduler"] = scheduler.state_dict()
    state["loop"] = dict(loop_state)
    dist_checkpointing.save(state, str(tmp))
    _save_rng(rng_file(tmp, rank))
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
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    layout: RunLayout,
    seed: int,
    pp_rank: int,
    islands: IslandState | None = None,
) -> tuple[dict[str, Any], bool]:
    """Collective: restore model, optimizer and scheduler (resharded to `layout` if it differs),
    and with `islands` this island's model / optimizer and the outer state.

    Returns the loop state and whether each rank's RNG streams were restored (same layout);
    otherwise they are re-seeded from (`seed`, saved step), identically on every rerun.
    """
    saved = read_saved_run(path)
    problem = check_resumable(saved, layout)
    if problem:
        raise ValueError(problem)
    saved_keys = set(dist_checkpointing.load_tensors_metadata(str(path))) if islands is not None else None
    template = _sharded_state(model, optimizer, is_loading=True, islands=islands, saved_keys=saved_keys)
    state = dist_checkpointing.load(template, str(path))
    unwrap_model(model).load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    if islands is not None:
        islands.outer.load_sharded(state["diloco"])
    scheduler.load_state_dict(state["scheduler"])
    if saved.layout is None or saved.layout.same_ranks(layout):
        _load_rng(rng_file(path, dist.get_rank()))
        return state["loop"], True
    seed_everything(seed + int(state["loop"]["step"]), pp_rank=pp_rank)
    return state["loop"], False


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """`optimizer.load_state_dict(state)`, around a megatron-core 0.16 bug without Apex/TE.

    With torch's Adam every parameter's state holds a 'step' tensor, which megatron's
    `DistributedOptimizer.load_state_dict` sets from the saved param groups and then expects among
    the loaded per-parameter tensors, which never carry it (`_set_main_param_and_optimizer_states`:
    KeyError 'step'); and it sets ONE tensor for all parameters, which torch's foreach Adam then
    increments once per parameter per step (wrong bias correction after a resume). So the
    parameter state is loaded here with the steps held aside, through megatron's own loader for
    the saved sharding type, and every parameter gets its own step back; the rest is megatron's.
    """
    leaves = leaf_optimizers(optimizer)
    parts = [state] if len(leaves) == 1 else [v for _, v in sorted(state.items())]
    for leaf, part in zip(leaves, parts, strict=True):
        if isinstance(leaf, DistributedOptimizer) and isinstance(leaf.optimizer, torch.optim.Adam):
            _load_distributed_adam(leaf, dict(part))
        else:
            leaf.load_state_dict(_with_zero_steps(part))
    if len(leaves) > 1:
        optimizer._synchronize_steps()


def _with_zero_steps(state: dict[str, Any]) -> dict[str, Any]:
    """Megatron's FP32/Float16 optimizers save Adam's step once (`common_step`) and drop it when it
    is 0 (`if step:`), so the state of an Adam that has not stepped loads as moments without a step,
    which torch's Adam refuses (KeyError 'step'). Step 0 is what was saved."""
    inner = state.get("optimizer", state)  # Float16Optimizer nests the torch state one level down
    per_param = inner.get("state", {}) if isinstance(inner, dict) else {}
    if "common_step" not in per_param:
        for entry in per_param.values():
            if isinstance(entry, dict) and "exp_avg" in entry:
                entry.setdefault("step", torch.tensor(0.0))
    return state


def _load_distributed_adam(leaf: DistributedOptimizer, state: dict[str, Any]) -> None:
    param_state, sharding = state.pop("param_state"), state.pop("param_state_sharding_type")
    loaders = {
        "fully_reshardable": leaf.load_parameter_state_from_fully_reshardable,
        "fully_sharded_model_space": leaf.load_parameter_state_from_fs_model_space,
        "dp_reshardable": leaf.load_parameter_state_from_dp_reshardable,
    }
    if sharding not in loaders:
        raise ValueError(
            f"distributed optimizer state saved as {sharding!r}; this code loads {sorted(loaders)}"
        )
    leaf.load_state_dict(state)  # param groups (lr, step, ...); allocates the per-parameter state
    per_param = leaf.optimizer.state
    steps = {p: st.pop("step") for p, st in per_param.items() if "step" in st}
    try:
        loaders[sharding](param_state)
    finally:
        for p, step in steps.items():
            per_param[p]["step"] = step.clone()


def start_checkpoint_writer() -> None:
    """Start megatron's checkpoint-writer queue now, in a manager process that survives stop signals.

    megatron-core 0.16 (`dist_checkpointing.strategies.filesystem_async`) collects what its forked
    writer processes wrote through a queue served by a multiprocessing Manager, which it spawns at
    the first save (seconds on a busy box) and keeps in `_results_queue`. torchrun stops a rank by
    signalling its whole process group: that manager died with the SIGTERM that asks the rank for
    a stop checkpoint, and the checkpoint then failed (BrokenPipeError). Started here, before the
    first step, the manager ignores the stop signals and dies with its rank
    (`rank_entry.helper_process_init`); megatron finds the queue and uses it.
    """
    import multiprocessing.managers

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    if filesystem_async._results_queue is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=torch.multiprocessing.get_context("spawn"))
    manager.start(initializer=helper_process_init)
    queue = manager.Queue()  # the proxy keeps the manager alive
    # The manager unpickles what it is sent, so the first save's writer results made it import
    # torch.distributed.checkpoint then: ~2 s inside that save (a stop checkpoint's grace period,
    # or the last line of a resumed run that saves only at its end). One round trip now pays it.
    queue.put(WriteResult(index=MetadataIndex("warm-up"), size_in_bytes=0, storage_data=None))
    queue.get()
    filesystem_async._results_queue = queue
