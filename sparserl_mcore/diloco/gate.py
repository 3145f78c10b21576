"""PULSELoCo's compute-visible gate with error feedback, on one flat FP32 shard.

Per element, with the anchor a (FP32, identical on every island), the island's local master
weight w and the carried residual e:

    s = e + (a - w)                      the pseudo-gradient plus what earlier rounds held back
    send where bf16(a) != bf16(a - s)    the step s would change the BF16 weight of the anchor
    sent values: s (FP32, exact);  e <- s where not sent, 0 where sent

so sent + e == s bit for bit (every element is either sent whole or carried whole), and a
residual that keeps growing eventually crosses a BF16 rounding boundary and fires. The threshold
is relative to each anchor weight (at most half a BF16 ulp, ~|a| * 2^-8), not one global cut, so
small weights, whose BF16 cells are finer, fire more often: what `sync.positions`' magnitude
classes code cheaply.
"""

from __future__ import annotations

import torch
from torch import Tensor

# elements per pass: bounds the temporaries (a - s, two BF16 casts, a mask) to a few tens of MB
CHUNK = 1 << 22


def bf16_bits(x: Tensor) -> Tensor:
    """The BF16 bit pattern (int16) of FP32 values, round to nearest even: what a forward sees."""
    return x.to(torch.bfloat16).view(torch.int16)


def pulse_gate(anchor: Tensor, delta: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(ascending int64 indices, FP32 values) to send; `residual` becomes the new residual in place.

    anchor, delta (= anchor - local master), residual: 1-D FP32 of one length.
    """
    found_idx, found_val = [], []
    for start in range(0, anchor.numel(), CHUNK):
        a, s = anchor[start : start + CHUNK], residual[start : start + CHUNK]
        s.add_(delta[start : start + CHUNK])
        idx = (bf16_bits(a) != bf16_bits(a - s)).nonzero().squeeze(1)
        found_val.append(s.index_select(0, idx))
        s.index_fill_(0, idx, 0.0)
        found_idx.append(idx + start)
    if not found_idx:
        return torch.zeros(0, dtype=torch.int64, device=anchor.device), anchor.new_zeros(0)
    return torch.cat(found_idx), torch.cat(found_val)


def open_gate(anchor: Tensor, delta: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """Every element sent (no residual left): PULSELoCo's wire and sum, DiLoCo's numbers. For tests
    that pin `pulse` to `dense` bit for bit."""
    residual.add_(delta)
    values = residual.clone()
    residual.zero_()
    return torch.arange(anchor.numel(), device=anchor.device), values
