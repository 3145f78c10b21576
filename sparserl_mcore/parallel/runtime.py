"""Process-group start-up for learners: torch.distributed + megatron parallel state + RNG seeds.

`initialize(cfg, seed=...)` reads the launcher's environment (torchrun: RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT; srun: SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID with
MASTER_ADDR / MASTER_PORT exported by the sbatch script; neither: a single process), picks NCCL on
GPU and gloo on CPU, enters the CPU execution mode on CPU, and returns a `Runtime` describing this
rank. Code that needs a process group takes it from `Runtime.groups` (megatron's
`ProcessGroupCollection`: tp, pp, mp, cp, dp, dp_cp, embd, ...) or `Runtime.learner_group` (every
rank of the learner grid) and passes it down explicitly; nothing relies on the default group.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from sparserl_mcore.parallel import cpu_mode, islands
from sparserl_mcore.parallel.config import LaunchEnv, ParallelConfig, launch_env


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where this process sits in the learner's TP x CP x DP x PP grid."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu: bool
    parallel: ParallelConfig
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    groups: ProcessGroupCollection
    # Every rank of the TP x CP x DP x PP grid: the ranks that decide together (an update skipped or
    # gated, the host's samples and eval scores). megatron's grid spans the world today, so this is
    # the world group, named: collectives say which ranks they mean instead of defaulting to it.
    learner_group: dist.ProcessGroup
    # megatron's expert grid (MoE models; EP = 1, ETP = TP, expert-DP = DP for a layout without EP):
    # ep_rank picks this rank's experts, etp_rank its slice of each, expert-DP ranks hold copies.
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    expert_dp_rank: int = 0
    expert_dp_size: int = 1
    # DiLoCo islands (`parallel/islands.py`): with islands > 1, `groups` and dp_rank / dp_size are
    # the island's own; `island_group` holds this island's ranks, `cross_island_group` this rank's
    # counterparts in every island (None with one island).
    islands: int = 1
    island: int = 0
    island_group: dist.ProcessGroup | None = None
    cross_island_group: dist.ProcessGroup | None = None

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the whole job (every island's): the rollout batch splits over them."""
        return self.islands * self.dp_size

    @property
    def replica_rank(self) -> int:
        """This rank's data-parallel replica in the whole job (island-major)."""
        return self.island * self.dp_size + self.dp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


CUDA_BACKENDS = "cpu:gloo,cuda:nccl"
_generation = 0  # how many worlds this process has initialised (see _init_process_group)


def _init_process_group(launch: LaunchEnv, backend: str, device: torch.device) -> None:
    """Rendezvous through the launcher's store, under a per-initialisation key prefix.

    torchrun's agent store outlives a process group, so a second `initialize` in the same processes
    (tests, conversion re-sharding) would read the previous world's stale gloo addresses; every
    rank counts its initialisations identically, so a prefix per generation keeps them apart.
    """
    global _generation
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; call parallel.shutdown() first")
    if launch.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # A plain single process: no rendezvous needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size))
    _generation += 1
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"sparserl/world{_generation}", store),
        rank=launch.rank,
        world_size=launch.world_size,
        device_id=device if device.type == "cuda" else None,
    )


def seed_everything(seed: int, *, pp_rank: int) -> None:
    """Megatron's convention: stages differ (seed + 100 * pp_rank); TP ranks share the default
    stream and get distinct model-parallel streams from `model_parallel_cuda_manual_seed`."""
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def initialize(cfg: ParallelConfig, *, seed: int = 1234, backend: str | None = None) -> Runtime:
    """Initialise torch.distributed, megatron parallel state and RNG; return this rank's `Runtime`.

    `backend` defaults to NCCL for CUDA tensors plus gloo for CPU tensors when CUDA is available
    (`CUDA_BACKENDS`: the trainer's small control collectives, flags and byte counts, are CPU
    tensors, and NCCL alone refuses them), and to "gloo" otherwise; with gloo the CPU execution mode
    (`parallel.cpu_mode`) is entered until `shutdown()`. On failure everything set up so far is
    torn down again.
    """
    launch = launch_env()
    cfg.validate_world(launch.world_size)
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or (CUDA_BACKENDS if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        device = torch.device("cpu")
        cpu_mode.enable()
    try:
        _init_process_group(launch, backend, device)
        # islands: data parallel outermost, so an island is a contiguous block of ranks
        order = {"order": islands.ISLAND_ORDER} if cfg.islands > 1 else {}
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            context_parallel_size=cfg.context_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
            create_gloo_process_groups=use_cuda,
            **order,
        )
        seed_everything(seed, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        return _describe(launch, device, cfg)
    except BaseException:
        shutdown()
        raise


def _describe(launch: LaunchEnv, device: torch.device, cfg: ParallelConfig) -> Runtime:
    world = dist.group.WORLD
    assert world is not None, "torch.distributed is initialised before the runtime is described"
    groups = ProcessGroupCollection.use_mpu_process_groups()
    if cfg.islands > 1:
        split = islands.split_groups(
            groups, rank=launch.rank, world_size=launch.world_size, islands=cfg.islands
        )
        return Runtime(
            **_coordinates(launch, device, cfg),
            dp_rank=split.groups.dp.rank(),
            dp_size=split.groups.dp.size(),
            groups=split.groups,
            learner_group=world,
            islands=cfg.islands,
            island=split.island,
            island_group=split.island_group,
            cross_island_group=split.cross_island,
        )
    return Runtime(
        **_coordinates(launch, device, cfg),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        groups=groups,
        learner_group=world,
        island_group=world,
    )


def _coordinates(launch: LaunchEnv, device: torch.device, cfg: ParallelConfig) -> dict:
    """The Runtime fields that do not depend on islands."""
    return dict(
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        device=device,
        cpu=device.type == "cpu",
        parallel=cfg,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=cfg.tensor_model_parallel_size,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=cfg.pipeline_model_parallel_size,
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=cfg.context_parallel_size,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=cfg.expert_model_parallel_size,
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_size=cfg.expert_tensor_size,
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        expert_dp_size=parallel_state.get_expert_data_parallel_world_size(),
    )


def shutdown() -> None:
    """Tear down megatron parallel state and torch.distributed, and leave the CPU mode.

    No barrier: a rank leaving on an exception must not wait for peers stuck in a collective.
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_mode.disable()
