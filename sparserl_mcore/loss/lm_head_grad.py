"""The global lm_head gradient energy ||grad W_lm_head||_F^2 of a megatron-core model, for DGG.

Read between `optimizer.prepare_grads()` and the step, i.e. after `finalize_model_grads` reduced
the gradients over DP (and over the embedding group for tied weights):
- TP: the head is a ColumnParallelLinear sharded by vocabulary rows, so the squared norm is the
  sum of the shards' squared norms.
- PP: only the last stage holds the head; other stages contribute 0.
- DP: with the distributed optimizer each DP rank owns (has the reduced values of) a range of the
  gradient buffer: it contributes the squared norm of its range of `main_grad`, and the ranges
  partition the parameter. Without it every DP rank holds the full reduced gradient and only DP
  rank 0 contributes.
- Tied embeddings: the gradient counted is that of the shared matrix on the last stage, i.e. head
  gradient + embedding-lookup gradient (what the optimizer applies to the tied weight). With
  PP > 1 megatron all-reduces both copies' gradients over the embedding group first, so the
  number is the same for every PP layout.
One SUM all-reduce over `group` (every rank of the job) gives every rank the same float.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model
from torch import Tensor

from sparserl_mcore.parallel.optim_step import leaf_optimizers

__all__ = ["leaf_optimizers", "lm_head_grad_energy", "lm_head_weight"]


def lm_head_weight(model: torch.nn.Module) -> torch.nn.Parameter:
    """The (TP-local) lm_head weight of a last-stage GPTModel, wrapped in DDP or not."""
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _owned_grad(param: torch.nn.Parameter, optimizer, dp_group: dist.ProcessGroup) -> Tensor | None:
    """The part of `param`'s reduced gradient this DP rank is responsible for (None: nothing)."""
    main_grad = getattr(param, "main_grad", None)  # megatron DDP's fp32 grad buffer view
    grad = main_grad if main_grad is not None else param.grad
    if grad is None:
        return None
    distributed = [leaf for leaf in leaf_optimizers(optimizer) if isinstance(leaf, DistributedOptimizer)]
    if not distributed:
        return grad if dp_group.rank() == 0 else None
    for leaf in distributed:
        if param in leaf.model_param_gbuf_map:  # holds only the params this rank owns a range of
            owned = leaf._get_model_param_range_map(param)["param"]
            return grad.view(-1)[owned.start : owned.end]
    return None


def lm_head_grad_energy(
    model: torch.nn.Module,
    optimizer,
    *,
    is_last_stage: bool,
    dp_group: dist.ProcessGroup,
    group: dist.ProcessGroup | None,
) -> float:
    """||grad W_lm_head||_F^2 over the whole model, identical on every rank of `group`.

    A collective over `group` (None = the default world group): every rank must call it.
    Loss scaling (fp16) is divided out; bf16/fp32 have scale 1.
    """
    device = next(unwrap_model(model).parameters()).device
    local = torch.zeros((), dtype=torch.float64, device=device)
    if is_last_stage:
        grad = _owned_grad(lm_head_weight(model), optimizer, dp_group)
        if grad is not None:
            local = grad.detach().double().square().sum()
            scale = optimizer.get_loss_scale().to(torch.float64).reshape(())
            local = local / scale**2  # on the device: no host read
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return float(local)
