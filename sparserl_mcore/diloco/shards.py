"""This rank's FP32 master weights as megatron's optimizer holds them, as one flat vector.

What a rank owns, by optimizer:
- `DistributedOptimizer`: for each parameter with a range in this rank's buckets, the FP32 shard
  of that range (`shard_fp32_from_float16_groups`, or `shard_fp32_groups` for FP32 params, where
  the shard is a view of the param itself);
- `Float16OptimizerWithFloat16Params` (replicated mixed precision): every parameter's FP32 copy;
- `FP32Optimizer`: the FP32 parameters themselves.
The outer step reads and writes these in place and never gathers the model: with islands, the
ranks at the same place in every island own the same ranges of the same parameters (megatron
builds the same buckets from the same model and layout), so their flat vectors line up element
for element; `fingerprint()` lets the outer step check that once.

After the main weights change, `publish()` does what megatron's own step does after Adam: copy
main -> model params (BF16 casts included) and, for the distributed optimizer, all-gather the
updated params over the island's data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from torch import Tensor

from sparserl_mcore.sync.learner import mcore_name


@dataclass(frozen=True)
class Shard:
    """One parameter's owned FP32 range: main[:] holds param.view(-1)[start:end] in FP32."""

    name: str  # megatron parameter name (no wrapper prefixes)
    param: torch.nn.Parameter
    main: Tensor  # 1-D FP32, end - start elements, the optimizer's own storage
    start: int
    end: int
    offset: int  # where the range sits in the flat vectors


def megatron_leaves(optimizer) -> list:
    """The megatron optimizers under our wrappers (`optimizer_`) and a ChainedOptimizer."""
    inner = optimizer
    while hasattr(inner, "optimizer_"):
        inner = inner.optimizer_
    return list(getattr(inner, "chained_optimizers", [inner]))


def _pairs(leaf) -> list[tuple[torch.nn.Parameter, Tensor, int, int]]:
    """(model param, its FP32 main tensor, start, end) for every range `leaf` updates."""
    out = []
    if isinstance(leaf, DistributedOptimizer):
        groups = [
            *zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True),
            *zip(leaf.model_fp32_groups, leaf.shard_fp32_groups, strict=True),
        ]
        for params, mains in groups:
            for param, main in zip(params, mains, strict=True):
                owned = leaf._get_model_param_range_map(param)["param"]
                out.append((param, main, owned.start, owned.end))
    elif isinstance(leaf, Float16OptimizerWithFloat16Params):
        for params, mains in zip(leaf.float16_groups, leaf.fp32_from_float16_groups, strict=True):
            out += [(p, m, 0, p.numel()) for p, m in zip(params, mains, strict=True)]
        out += [(p, p, 0, p.numel()) for group in leaf.fp32_from_fp32_groups for p in group]
    elif isinstance(leaf, FP32Optimizer):
        out += [(p, p, 0, p.numel()) for group in leaf.param_groups for p in group["params"]]
    else:
        raise TypeError(f"{type(leaf).__name__}: DiLoCo islands support megatron's Adam optimizers only")
    return out


class MainShards:
    """The FP32 master ranges this rank's optimizer updates, in parameter-name order."""

    def __init__(self, optimizer, model: torch.nn.Module) -> None:
        names = {p: mcore_name(n) for n, p in model.named_parameters()}
        # every parameter of this rank, owned range or not: what the islands' weight hash covers
        self.params = sorted(((name, p) for p, name in names.items()), key=lambda item: item[0])
        self.leaves = megatron_leaves(optimizer)
        self.distributed = any(isinstance(leaf, DistributedOptimizer) for leaf in self.leaves)
        found = [pair for leaf in self.leaves for pair in _pairs(leaf) if pair[3] > pair[2]]
        found.sort(key=lambda pair: names[pair[0]])
        self.shards: list[Shard] = []
        offset = 0
        for param, main, start, end in found:
            if main.dtype != torch.float32:
                raise TypeError(f"{names[param]}: master weights are {main.dtype}; the PULSE gate needs FP32")
            self.shards.append(Shard(names[param], param, main.view(-1), start, end, offset))
            offset += end - start
        self.numel = offset
        self.device = self.shards[0].main.device if self.shards else torch.device("cpu")

    def read(self) -> Tensor:
        """A new flat FP32 copy of the owned master weights."""
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for s in self.shards:
            out[s.offset : s.offset + s.end - s.start].copy_(s.main)
        return out

    def write(self, flat: Tensor) -> None:
        """Set the owned master weights from a flat FP32 vector (then `publish`)."""
        for s in self.shards:
            s.main.copy_(flat[s.offset : s.offset + s.end - s.start])

    @torch.no_grad()
    def publish(self) -> None:
        """Master -> model params, and the island's param all-gather (as megatron's step ends)."""
        for leaf in self.leaves:
            if isinstance(leaf, (DistributedOptimizer, Float16OptimizerWithFloat16Params)):
                leaf._copy_main_params_to_model_params()
            if isinstance(leaf, DistributedOptimizer):
                for chunk in leaf.model_chunks:
                    chunk.start_param_sync(force_sync=True)

    def fingerprint(self) -> int:
        """A hash of (name, start, end) of every owned range: equal across islands or they cannot
        exchange element-wise."""
        h = xxhash.xxh3_64()
        for s in self.shards:
            h.update(f"{s.name}:{s.start}:{s.end};".encode())
        return h.intdigest() & (2**63 - 1)
