"""The DWD signal: how far one optimizer update moves lm_head, against the middle layers.

Disproportionate Weight Divergence (../shared/research/dgg.md, docs/loss.md): when a rollout batch
is reused too often, the lm_head's weights start to move much more per update while the
intermediate layers stay still, and then the run collapses. Per applied update this measures

    rel_change = ||W_after - W_before||_F / ||W_before||_F

for two groups of parameters, on the optimizer's fp32 main weights (what the step writes: a BF16
model copy would round small updates away):
  lm_head  the output layer's weight (the shared embedding matrix when tied), last PP stage only;
  middle   every parameter of the decoder layers in the middle half of the depth, global layer
           index in [L // 4, L - L // 4) (all layers of a model with fewer than 4).
Each element counts once in the job: TP shards and PP stages hold disjoint parameters, a parameter
replicated over TP (layer norms) counts on TP rank 0; with the distributed optimizer each DP rank
holds the main weights of its own range, without it every DP rank holds them all and DP rank 0
counts. One SUM all-reduce of four float64 numbers over `group`.
Cost: an fp32 copy of this rank's tracked main weights (1/DP of them with the distributed
optimizer), taken before the step and dropped after it; `dgg.weight_change=false` turns it off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import unwrap_model
from torch import Tensor

from sparserl_mcore.loss.lm_head_grad import leaf_optimizers, lm_head_weight

GROUPS = ("lm_head", "middle")


def _main_weights(optimizer, dp_rank: int) -> dict[int, Tensor]:
    """id(model param) -> the fp32 main weights this rank counts for it (its owned range)."""
    out: dict[int, Tensor] = {}
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, DistributedOptimizer):  # shard main params cover exactly the owned range
            pairs = [
                (leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                (leaf.model_fp32_groups, leaf.shard_fp32_groups),
            ]
        elif dp_rank != 0:  # replicated over DP: rank 0 counts
            continue
        elif isinstance(leaf, Float16OptimizerWithFloat16Params):
            pairs = [
                (leaf.float16_groups, leaf.fp32_from_float16_groups),
                (leaf.fp32_from_fp32_groups, leaf.fp32_from_fp32_groups),
            ]
        else:  # FP32Optimizer: the model params are the main params
            params = leaf.get_parameters() if not getattr(leaf, "is_stub_optimizer", False) else []
            pairs = [([params], [params])]
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                # None: a precision-aware optimizer keeps the main weights inside itself
                out.update((id(p), m) for p, m in zip(model_group, main_group, strict=True) if m is not None)
    return out


def middle_layer_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters of this stage's decoder layers in the middle half of the model's depth."""
    gpt = unwrap_model(model)
    total = gpt.config.num_layers
    lo, hi = total // 4, total - total // 4
    return [
        p for layer in gpt.decoder.layers if lo <= layer.layer_number - 1 < hi for p in layer.parameters()
    ]


class WeightChange:
    """`before_step()` copies the tracked main weights; `after_step()` returns the relative changes.

    Both are local; `after_step` is a collective over `group` (every rank of the job calls it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        is_last_stage: bool,
        tp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        group: dist.ProcessGroup | None,
    ) -> None:
        main = _main_weights(optimizer, dp_group.rank())
        tracked = {
            "lm_head": [lm_head_weight(model)] if is_last_stage else [],
            "middle": middle_layer_params(model),
        }
        self._mains = {
            name: [
                main[id(p)]
                for p in params
                if id(p) in main and param_is_not_tensor_parallel_duplicate(p, tp_group)
            ]
            for name, params in tracked.items()
        }
        self._before: dict[str, list[Tensor]] = {}
        self._group = group
        self._device = next(unwrap_model(model).parameters()).device

    def before_step(self) -> None:
        self._before = {name: [m.detach().clone() for m in mains] for name, mains in self._mains.items()}

    def after_step(self) -> dict[str, float]:
        """dwd/{lm_head,middle}_rel_change and dwd/ratio (lm_head over middle), same on every rank."""
        sums = torch.zeros(2 * len(GROUPS), dtype=torch.float64, device=self._device)
        for i, name in enumerate(GROUPS):
            for now, then in zip(self._mains[name], self._before.pop(name), strict=True):
                sums[2 * i + 1] += _norm_sq(then)
                sums[2 * i] += _norm_sq(then.sub_(now.detach()))  # the copy becomes the change
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self._group)
        rel = dict(zip(GROUPS, (sums[0::2] / sums[1::2]).sqrt().tolist(), strict=True))  # one host read
        out = {f"dwd/{name}_rel_change": value for name, value in rel.items()}
        out["dwd/ratio"] = rel["lm_head"] / rel["middle"] if rel["middle"] > 0 else float("nan")
        return out


def _norm_sq(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()
