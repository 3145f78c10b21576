"""The optimizer step's gradient statistics with one host sync: non-finite verdict, norm and clip.

Megatron without apex/TE computes the grad norm with `utils.local_multi_tensor_l2_norm`, which
turns every per-parameter norm into a Python float (one host sync per parameter: ~170 at 24
layers), clips with a per-parameter `copy_`, and the trainer's non-finite check synced once per
gradient on top. Here, over megatron's own gradient lists and groups:

- the per-parameter norms come from one `torch._foreach_norm`, and a parameter holds a NaN/Inf
  exactly when its norm is not finite, unless the fp32 norm overflowed; the rare verdict "not
  finite" is therefore confirmed element-wise before a step is skipped (a second sync, only then);
- the squared norm and the non-finite count travel in ONE all-reduce per grad-statistics group and
  reach the host in ONE copy, the only host sync of a step;
- clipping multiplies with one `torch._foreach_mul_` by megatron's own host coefficient.

Numerics: on CPU the norm is megatron's `get_grad_norm_fp32` value bit for bit (the same
per-tensor norms, fp32 vector norm, square, all-reduce and `** 0.5` on the host; `ChainedOptimizer`'s
rule for optimizers with different groups) and the clip writes what `clip_grad_by_total_norm_fp32`
writes, both checked against megatron in tests/test_optim_step.py. On GPU the foreach norm kernel
sums each tensor in its own order (last bits of the norm differ from per-tensor `torch.norm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class GradCheck:
    """What the step needs to know about the reduced gradients, identical on the group's ranks."""

    found_inf: bool  # some gradient holds NaN/Inf (or megatron's loss scaler found one)
    grad_norm: float  # megatron's global L2 grad norm (its `get_grad_norm()` value)


def leaf_optimizers(optimizer: Any) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _grads(leaf: Any) -> list[Tensor]:
    """The gradients megatron's grad norm counts (no TP duplicates, no shared copies)."""
    if getattr(leaf, "is_stub_optimizer", False):
        return []
    return list(leaf.get_main_grads_for_grad_norm())


def _parts(optimizer: Any) -> list[tuple[list[Tensor], dist.ProcessGroup]]:
    """(gradients, grad-statistics group) per norm megatron computes: one when the optimizers share
    their group (`ChainedOptimizer.get_grad_norm`), else one per optimizer."""
    leaves = leaf_optimizers(optimizer)
    groups = [leaf.get_grad_stats_parallel_group() for leaf in leaves]
    if all(g == groups[0] for g in groups):
        return [([g for leaf in leaves for g in _grads(leaf)], groups[0])]
    return [(_grads(leaf), group) for leaf, group in zip(leaves, groups, strict=True)]


def _local_stats(grads: list[Tensor], device: torch.device) -> Tensor:
    """[squared L2 norm, count of non-finite per-tensor norms] of this rank's gradients, fp32."""
    if not grads:
        return torch.zeros(2, dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(grads))
    squared = torch.norm(norms) ** 2.0  # megatron: norm of the per-tensor norms, then ** norm_type
    return torch.stack([squared, (~torch.isfinite(norms)).sum().to(torch.float32)])


def _confirm_non_finite(grads: list[Tensor], group: dist.ProcessGroup, device: torch.device) -> bool:
    """Element-wise check of one group's gradients, reached only when one of their norms was not
    finite (NaN/Inf, or an fp32 overflow of finite values); that verdict is the same on the group's
    ranks, so they all take this collective together."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(torch.float32))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def check_grads(optimizer: Any, *, found_inf: bool = False) -> GradCheck:
    """The non-finite verdict and the grad norm of megatron `optimizer` after `prepare_grads()`,
    with one host sync. `found_inf`: megatron's own verdict (its fp16 loss scaler), OR-ed in.

    A collective over each grad-statistics group: every rank of the optimizer calls it.
    """
    parts = _parts(optimizer)
    device = _device(optimizer)
    stats = []
    for grads, group in parts:
        local = _local_stats(grads, device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        stats.append(local)
    values = torch.cat(stats).tolist()  # the one device-to-host copy
    squares, flagged = values[0::2], values[1::2]
    norms = [square ** (1.0 / 2.0) for square in squares]  # get_grad_norm_fp32's host root
    if len(norms) == 1:
        grad_norm = norms[0]
    else:  # ChainedOptimizer.get_grad_norm with unshared groups
        grad_norm = math.sqrt(sum([(n if n else 0.0) ** 2 for n in norms]))
    for (grads, group), count in zip(parts, flagged, strict=True):
        if count > 0:
            found_inf = _confirm_non_finite(grads, group, device) or found_inf
    return GradCheck(found_inf=found_inf, grad_norm=grad_norm)


def prepare_and_check(optimizer: Any) -> GradCheck:
    """`prepare_grads()` plus `check_grads`. Wrappers of megatron's optimizer (the trainer's
    `NonFiniteGradGuard`, DiLoCo's `IslandOptimizer`) define `prepare_and_check` themselves."""
    if hasattr(type(optimizer), "prepare_and_check"):
        return optimizer.prepare_and_check()
    return check_grads(optimizer, found_inf=bool(optimizer.prepare_grads()))


def clip_grads(optimizer: Any, grad_norm: float) -> None:
    """Clip every optimizer's gradients to its `clip_grad` by the global `grad_norm`, as megatron's
    `clip_grad_by_total_norm_fp32` does (same host coefficient), with one foreach multiply."""
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "is_stub_optimizer", False) or leaf.config.clip_grad <= 0:
            continue
        decoupled = leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        attr = "decoupled_grad" if decoupled else "grad"
        grads = [getattr(p, attr) for p in leaf.get_parameters() if getattr(p, attr, None) is not None]
        coefficient = leaf.config.clip_grad / (grad_norm + 1.0e-6)
        if grads and coefficient < 1.0:
            torch._foreach_mul_([g.detach() for g in grads], coefficient)


def _device(optimizer: Any) -> torch.device:
    for leaf in leaf_optimizers(optimizer):
        for p in leaf.get_parameters() if not getattr(leaf, "is_stub_optimizer", False) else []:
            return p.device
    if torch.cuda.is_available():  # a rank without parameters still joins NCCL collectives
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
