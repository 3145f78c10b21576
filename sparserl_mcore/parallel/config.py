"""Parallel layout of the learner, in megatron-core's own names (expert parallelism included).

`ParallelConfig` is pure Python (no torch import) so configs can be validated before any process
group exists; `validate_world` / `validate_model` check a layout against a world size and a model
shape and name the numbers that do not fit.

Pipeline stages may hold different layer counts, split the way megatron-core splits them
(`num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`, the middle stages
equal). `stage_layers(num_layers)` is the one answer to "how many decoder layers does each stage
hold": `model_providers` turns it into megatron's TransformerConfig fields, `ckpt.layout` into
each stage's global layer offset. Left unset, the split is chosen to balance the stages.

`launch_env()` reads this process's rank and world size from the launcher's environment (torchrun,
srun), also without torch, so the launching process and every rank agree on them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

TOKEN_DISPATCHERS = ("alltoall", "allgather")  # megatron's `flex` needs DeepEP / HybridEP (not shipped)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor / pipeline / context / expert parallel sizes; data parallel is what remains of the world.

    Mixture-of-experts layers are laid out on megatron's second grid: `expert_model_parallel_size`
    (EP) ranks split the experts, each expert's MLP is split over `expert_tensor_parallel_size`
    (ETP; None: the same as TP) ranks, and the expert data-parallel size is what remains, so the
    world must divide by both TP x PP x CP and ETP x EP x PP. `moe_token_dispatcher_type` is how
    tokens reach their experts' ranks (megatron's all-to-all or all-gather dispatcher).

    islands: how many groups of whole data-parallel replicas train apart (DiLoCo islands: nodes,
    racks or sites joined by slow links). Inside an island TP / PP / CP / DP work as with one;
    across islands only the outer sync of `sparserl_mcore.diloco` travels, every
    `diloco.inner_steps` optimizer steps. 1 (the default): one island, plain data parallelism.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # Decoder layers on the first / last pipeline stage; the other stages share the rest equally.
    # None for both: the balanced split of `balanced_stage_layers` (equal stages when they divide).
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_token_dispatcher_type: str = "alltoall"
    islands: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "islands",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"expert_tensor_parallel_size={etp!r}: must be an integer >= 1 (null: TP)")
        if etp is not None and self.tensor_model_parallel_size % etp:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} does not divide tensor_model_parallel_size="
                f"{self.tensor_model_parallel_size}; use a divisor of it (null: equal to TP)"
            )
        if self.islands > 1 and self.expert_model_parallel_size > 1:
            raise ValueError(
                f"islands={self.islands} with expert_model_parallel_size={self.expert_model_parallel_size}: "
                "DiLoCo islands and expert parallelism are not combined: an island smaller than an "
                "expert-parallel group would cut its token all-to-all at the island border (each rank "
                "then builds every expert, unlike the layout its weights, sync and checkpoint use), and "
                "islands of whole expert-parallel groups are untested (the outer step over the expert "
                "optimizer's shards; docs/islands.md); use one of them"
            )
        if self.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
            raise ValueError(
                f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}; choose one of "
                f"{', '.join(TOKEN_DISPATCHERS)} (megatron's flex dispatcher needs DeepEP, not installed)"
            )
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1 (null: the balanced split)")
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(f"{name}={value} needs pipeline_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica (TP * PP * CP)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        return tp * pp * self.context_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """ETP, with megatron's default (None: equal to TP) resolved."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_model_parallel_ranks(self) -> int:
        """Ranks holding one copy of every expert (ETP * EP * PP)."""
        return self.expert_tensor_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def min_world_size(self) -> int:
        """The fewest ranks this layout runs on: a multiple of both TP*PP*CP and ETP*EP*PP."""
        return math.lcm(self.model_parallel_size, self.expert_model_parallel_ranks)

    @property
    def uses_expert_parallelism(self) -> bool:
        return self.expert_model_parallel_size > 1 or self.expert_tensor_parallel_size is not None

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
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        if world_size % self.expert_model_parallel_ranks:
            raise ValueError(
                f"world size {world_size} is not divisible by ETP*EP*PP = {etp}*{ep}*{pp} = "
                f"{self.expert_model_parallel_ranks} (megatron's expert grid); launch a multiple of "
                f"{self.expert_model_parallel_ranks} ranks or change expert_model_parallel_size"
            )
        replicas = world_size // self.model_parallel_size
        if replicas % self.islands:
            raise ValueError(
                f"islands={self.islands} does not divide the {replicas} data-parallel replicas of "
                f"world size {world_size} (TP*PP*CP = {self.model_parallel_size}); launch a multiple "
                f"of {self.islands * self.model_parallel_size} ranks or change parallel.islands"
            )

    def rank_flags(self) -> list[str]:
        """This layout as the flags of the conversion and verification rank entries
        (`launch.convert`, `launch.verify`): --tp, --pp, --ep and, when set, --etp."""
        flags = ["--tp", str(self.tensor_model_parallel_size), "--pp", str(self.pipeline_model_parallel_size)]
        flags += ["--ep", str(self.expert_model_parallel_size)]
        if self.expert_tensor_parallel_size is not None:
            flags += ["--etp", str(self.expert_tensor_parallel_size)]
        return flags

    def validate_model(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        num_experts: int | None = None,
        moe_ffn_hidden_size: int | None = None,
    ) -> None:
        """Raise ValueError if the model shape cannot be split this way (`num_experts` None: dense)."""
        self._validate_experts(num_experts, moe_ffn_hidden_size)
        tp = self.tensor_model_parallel_size
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
        self.stage_layers(num_layers)

    def _validate_experts(self, num_experts: int | None, moe_ffn_hidden_size: int | None) -> None:
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        if num_experts is None:
            if self.uses_expert_parallelism:
                raise ValueError(
                    f"expert_model_parallel_size={ep}, expert_tensor_parallel_size="
                    f"{self.expert_tensor_parallel_size}: the model has no experts (dense MLP); "
                    "leave both at their defaults (1, null)"
                )
            return
        if num_experts % ep:
            raise ValueError(
                f"expert_model_parallel_size={ep} does not divide num_experts={num_experts}; "
                f"choose an EP size that divides {num_experts}"
            )
        if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp:
            raise ValueError(
                f"expert tensor parallel size {etp} does not divide moe_intermediate_size="
                f"{moe_ffn_hidden_size}; set expert_tensor_parallel_size to a divisor of it"
            )

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers held by each pipeline stage (megatron's first/last/middle split).

        Raises ValueError naming the numbers when the requested split is impossible.
        """
        pp = self.pipeline_model_parallel_size
        if pp > num_layers:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} is larger than num_hidden_layers={num_layers}; "
                "every pipeline stage needs at least one layer"
            )
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if first is None and last is None:
            return balanced_stage_layers(num_layers, pp)
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        given = ", ".join(
            f"{name}={value}"
            for name, value in (
                ("num_layers_in_first_pipeline_stage", first),
                ("num_layers_in_last_pipeline_stage", last),
            )
            if value is not None
        )
        if (middle_stages == 0 and middle_layers != 0) or (middle_stages and middle_layers < middle_stages):
            raise ValueError(
                f"{given}: {middle_layers} of num_hidden_layers={num_layers} remain for the other "
                f"{middle_stages} of pipeline_model_parallel_size={pp} stages; every stage needs at "
                "least one layer and every layer a stage"
            )
        if middle_stages and middle_layers % middle_stages:
            raise ValueError(
                f"{given}: {middle_layers} of num_hidden_layers={num_layers} remain for "
                f"{middle_stages} middle pipeline stages, which must hold equal counts; "
                "change the first/last stage counts (or leave both unset for a balanced split)"
            )
        per_middle = middle_layers // middle_stages if middle_stages else 0
        counts = [per_middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)


def balanced_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """The default split: the fewest layers on the busiest stage, then the smallest spread between
    stages, then fewer layers on the last stage (it also computes the output layer and loss), then
    on the first (the embedding). Equal counts whenever `pp` divides `num_layers`.

    Megatron's uneven pipelines fix the first and last stage counts and split the rest equally over
    the middle stages, so those are the candidates: e.g. 5 layers on 2 stages -> (3, 2), on 3 stages
    -> (2, 2, 1); 28 on 3 -> (9, 10, 9); 36 on 5 -> (8, 7, 7, 7, 7).
    """
    if pp == 1:
        return (num_layers,)
    best: tuple[tuple[int, int, int, int], tuple[int, ...]] | None = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            middle_layers = num_layers - first - last
            if pp == 2:
                if middle_layers:
                    continue
                counts: tuple[int, ...] = (first, last)
            elif middle_layers < pp - 2 or middle_layers % (pp - 2):
                continue
            else:
                counts = (first, *[middle_layers // (pp - 2)] * (pp - 2), last)
            key = (max(counts), max(counts) - min(counts), last, first)
            if best is None or key < best[0]:
                best = (key, counts)
    assert best is not None, "pp <= num_layers always has a split (one layer per stage at worst)"
    return best[1]


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
