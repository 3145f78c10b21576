"""Python ints -> int64 tensor, cheaply: the scheduler builds a few such index tensors every step.

`torch.tensor(list)` inspects every element's Python type on its own: for a decode step's few hundred
ints (page tables, token ids, positions, slots) that costs tens of microseconds, as much as a
layer's attention kernel at rollout sizes. `array.array` converts the list in one C loop and
`torch.frombuffer` wraps its buffer without a copy (the tensor keeps the array alive).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 tensor [len(values)] on `device` (built on the host, moved when `device` is not the CPU)."""
    if not values:
        host = torch.empty(0, dtype=torch.int64)
    else:
        host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)
