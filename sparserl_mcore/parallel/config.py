"""Parallel layout of the learner, in megatron-core's own names.

`ParallelConfig` is pure Python (no torch import) so configs can be validated before any process
group exists; `validate_world` / `validate_model` check a layout against a world size and a model
shape and name the numbers that do not fit. `launch_env()` reads this process's rank and world
size from the launcher's environment (torchrun, srun), also without torch, so the launching
process and every rank agree on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor / pipeline / context parallel sizes; data parallel is what remains of the world."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica (TP * PP * CP)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        return tp * pp * self.context_parallel_size

    def validate_world(self, world_size: int) -> None:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = "
                f"{self.model_parallel_size}; launch a multiple of {self.model_parallel_size} ranks "
                "or change tensor/pipeline/context_model_parallel_size"
            )

    def validate_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        """Raise ValueError if the model shape cannot be split this way."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if num_heads % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide num_attention_heads={num_heads}; "
                f"choose a TP size that divides {num_heads}"
            )
        if num_kv_heads % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide num_key_value_heads={num_kv_heads}; "
                f"choose a TP size that divides {num_kv_heads}"
            )
        if pp > num_layers:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} is larger than num_hidden_layers={num_layers}; "
                "every pipeline stage needs at least one layer"
            )
        if num_layers % pp:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} does not divide num_hidden_layers={num_layers}; "
                "stages get equal layer counts, choose a PP size that divides the layer count"
            )


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch, as the launcher's environment says."""

    rank: int
    world_size: int
    local_rank: int


def launch_env() -> LaunchEnv:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, srun's SLURM_* inside a step, else one process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    # SLURM_STEP_NUM_TASKS exists only inside an srun step: a plain process in a batch script
    # (which also sees SLURM_PROCID=0 and the allocation's SLURM_NTASKS) stays a single process.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        if missing:
            raise RuntimeError(
                f"running under srun but {', '.join(missing)} is not set; export MASTER_ADDR (first "
                "node of the allocation) and MASTER_PORT in the sbatch script"
            )
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        return LaunchEnv(rank, world, int(env.get("SLURM_LOCALID", 0)))
    return LaunchEnv(0, 1, 0)
