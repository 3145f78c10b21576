"""Global denominators and metric reduction for losses computed piecewise.

A loss or metric over the global batch is split into per-(micro-batch, DP rank) pieces. Every
piece divides its LOCAL numerator by the GLOBAL denominator, so summing the pieces over
micro-batches and DP ranks gives exactly the global value. The denominators come from a
`*Totals` object: computed locally by default (single batch), or all-reduced across ranks by the
caller before the loss is evaluated (`.all_reduce(group)`).

Metrics are dicts of 0-d tensors. Each name reduces by sum, except the names in `MAX_METRICS`,
which reduce by max; `reduce_metrics` applies that rule across micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

# Metrics that reduce by max across micro-batches and ranks; every other metric is a sum.
MAX_METRICS: frozenset[str] = frozenset(
    {"correction/abs_logp_diff_max", "correction/weight_max", "staleness/lag_max"}
)


def all_reduce_fields(obj, group: dist.ProcessGroup | None):
    """One SUM all-reduce of all tensor fields of a totals dataclass (float64 for exact counts)."""
    names = [f.name for f in fields(obj)]
    vec = torch.stack([getattr(obj, n).to(torch.float64) for n in names])
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    return type(obj)(**{n: vec[i] for i, n in enumerate(names)})


@dataclass(frozen=True)
class LossTotals:
    """Denominators of the policy loss over the whole optimizer step (all micro-batches, DP ranks).

    sequences: number of sequences (vetoed ones included: they count in seq-mean-then-batch-mean).
    tokens: number of tokens in the final (post-correction) loss mask.
    """

    sequences: Tensor
    tokens: Tensor

    @classmethod
    def local(cls, mask: Tensor) -> LossTotals:
        """Totals of one [batch, seq] loss mask."""
        return cls(
            sequences=torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device),
            tokens=mask.sum(dtype=torch.float64),
        )

    def all_reduce(self, group: dist.ProcessGroup | None) -> LossTotals:
        return all_reduce_fields(self, group)

    def __add__(self, other: LossTotals) -> LossTotals:
        return LossTotals(sequences=self.sequences + other.sequences, tokens=self.tokens + other.tokens)


def reduce_metrics(
    pieces: Iterable[dict[str, Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Combine metric pieces (micro-batches) locally, then across `group`; returns plain floats.

    `group=None` reduces locally only. Otherwise this is a collective: every rank of `group` must
    call it with the same metric names.
    """
    sums: dict[str, Tensor] = {}
    maxes: dict[str, Tensor] = {}
    for piece in pieces:
        for name, value in piece.items():
            value = value.detach().to(torch.float64).reshape(())
            if name in MAX_METRICS:
                maxes[name] = torch.maximum(maxes[name], value) if name in maxes else value
            else:
                sums[name] = sums[name] + value if name in sums else value
    if group is not None and dist.get_world_size(group) > 1:
        sums, maxes = _all_reduce_dicts(sums, maxes, group)
    named = {**sums, **maxes}
    if not named:
        return {}
    values = torch.stack(list(named.values())).tolist()  # one host read for every metric
    return dict(zip(named, values, strict=True))


def _all_reduce_dicts(
    sums: dict[str, Tensor], maxes: dict[str, Tensor], group: dist.ProcessGroup | None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Two collectives (one SUM, one MAX) over names sorted identically on every rank."""
    out: list[dict[str, Tensor]] = []
    for values, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
        names = sorted(values)
        if not names:
            out.append({})
            continue
        vec = torch.stack([values[n] for n in names])
        dist.all_reduce(vec, op=op, group=group)
        out.append({n: vec[i] for i, n in enumerate(names)})
    return out[0], out[1]
