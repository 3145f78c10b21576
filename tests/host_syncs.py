"""Host-sync sanitizer and op counter for tests of device-only regions (CUDA-graph capture, a
sync-free optimizer step).

`forbid_host_syncs()` makes every way a tensor's value reaches the host raise inside its block:
`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`int()`/`float()` of a tensor, and the aten ops
whose output shape depends on values (`nonzero`, `unique`, `masked_select`, ...), which sync on a
GPU. On the CPU those reads cost nothing, so only a sanitizer shows that code written for the GPU
keeps them out. `count_ops()` counts the aten ops dispatched in its block (what a graph replay
would save on a GPU).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read a value on the host, or whose output shape depends on tensor values
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "masked_select",
    "repeat_interleave",
    "_assert_async",
}
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _Forbid(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            raise RuntimeError(f"host sync in a device-only region: aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[None]:
    """Raise RuntimeError("host sync ...") on any host read of a tensor value inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name: str):
        def method(self, *args, **kwargs):
            raise RuntimeError(f"host sync in a device-only region: Tensor.{name}()")

        return method

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        with _Forbid():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class OpCount(TorchDispatchMode):
    """Counts dispatched aten ops by name (`counts`), `total` in all."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops() -> OpCount:
    """`with count_ops() as ops: ...` then `ops.total`, `ops.counts`."""
    return OpCount()
