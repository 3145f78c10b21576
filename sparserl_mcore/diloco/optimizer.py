"""The learner's optimizer with islands: megatron's inner step, then the outer step every H.

`IslandOptimizer` wraps the optimizer the update step already drives (`prepare_grads`,
`step_with_ready_grads`), so the RL loss and update loop stay as they are:
- `prepare_grads`: megatron's verdict on non-finite gradients is reached inside an island (its
  grad-statistics group); here it is OR-ed over every learner rank, so all islands skip the same
  updates and their inner step counts stay equal (the DGG gate is already agreed over the learner);
- `step_with_ready_grads`: megatron's step, then `OuterStep.after_inner_step`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from sparserl_mcore.diloco.config import DiLoCoConfig
from sparserl_mcore.diloco.outer import OuterStep
from sparserl_mcore.diloco.shards import MainShards
from sparserl_mcore.parallel.optim_step import GradCheck, prepare_and_check


class IslandOptimizer:
    """megatron optimizer (or a wrapper of it) + the outer step; everything else is the inner one's."""

    def __init__(self, optimizer: Any, outer: OuterStep, group: dist.ProcessGroup, device: torch.device):
        self.optimizer_, self.outer, self.group, self.device = optimizer, outer, group, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer_, name)

    def prepare_and_check(self) -> GradCheck:
        """The inner optimizer's verdict and grad norm, the verdict OR-ed over every learner rank."""
        check = prepare_and_check(self.optimizer_)
        found = torch.tensor([float(check.found_inf)], device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return replace(check, found_inf=bool(found.item() > 0))

    def prepare_grads(self) -> bool:
        return self.prepare_and_check().found_inf

    def step(self):
        raise TypeError(
            "IslandOptimizer is driven by prepare_grads() and step_with_ready_grads() "
            "(as loss.megatron_step does): megatron's step() would bypass the islands' agreement"
        )

    def step_with_ready_grads(self) -> bool:
        applied = bool(self.optimizer_.step_with_ready_grads())
        if applied:
            self.outer.after_inner_step()
        return applied


def with_islands(optimizer: Any, model: torch.nn.Module, cfg: DiLoCoConfig, runtime: Any) -> IslandOptimizer:
    """Collective: the outer step over `runtime`'s islands around `optimizer` (built over `model`)."""
    shards = MainShards(optimizer, model)
    if not shards.distributed and runtime.dp_size > 1:
        raise ValueError(
            f"parallel.islands={runtime.islands} with optimizer.distributed=false and "
            f"{runtime.dp_size} data-parallel replicas per island: every replica would exchange the "
            "same master weights; set optimizer.distributed=true (or one replica per island)"
        )
    outer = OuterStep(
        shards,
        cfg,
        island=runtime.island,
        islands=runtime.islands,
        cross_group=runtime.cross_island_group,
        learner_group=runtime.learner_group,
    )
    return IslandOptimizer(optimizer, outer, runtime.learner_group, runtime.device)
