"""Count the places where the host reads tensor values: the host syncs of a region on a GPU.

On a GPU each such read waits for every queued kernel, so a step that reads values per parameter
serialises host and device. The reads are counted on CPU as well (there they cost nothing, but the
same code paths run), which is how tests pin "at most one host sync per optimizer step" without a
GPU:

- `aten._local_scalar_dense`: `.item()`, `float(t)`, `int(t)`, `bool(t)` and C++ callers of them,
  seen by a `TorchDispatchMode`;
- device-to-host copies (`aten._to_copy` / `aten.copy_` from a non-CPU tensor to a CPU one);
- `Tensor.tolist()` and `Tensor.numpy()`, which read memory without dispatching an operator, and
  `torch.tensor(data)` with tensors inside `data` (megatron's fallback grad norm builds one from a
  list of per-parameter norms: one read each): wrapped while the counter is active (an instrument
  entered explicitly; the originals return on exit).

Usage: `with HostSyncCounter() as syncs: ...; syncs.count, syncs.sites`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_COPIES = (_aten._to_copy.default, _aten.copy_.default)


def _device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is _aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1]
    return src.device.type != "cpu" and dst.device.type == "cpu"


class HostSyncCounter(TorchDispatchMode):
    """Counts host reads of tensor values inside its `with` block (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._originals: dict[str, Any] = {}
        self._reading = False  # a torch function mode re-enters the wrapped method: count once

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            self.sites["item"] += 1
        elif func in _COPIES and _device_to_host(func, args, kwargs):
            self.sites["device_to_host_copy"] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))
        self._originals["tensor"] = torch.tensor
        torch.tensor = self._counted_constructor(torch.tensor)
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        for name, original in self._originals.items():
            setattr(torch if name == "tensor" else torch.Tensor, name, original)
        self._originals = {}

    def _counted(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._reading:
                return original(tensor, *args, **kwargs)
            self.sites[name] += 1
            self._reading = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._reading = False

        return read

    def _counted_constructor(self, original: Any) -> Any:
        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            reads = _tensors_in(data)
            if reads:
                self.sites["tensor_from_tensors"] += reads
            return original(data, *args, **kwargs)

        return tensor


def _tensors_in(data: Any) -> int:
    """Tensors inside a (nested) list or tuple: each is read by `torch.tensor(data)`."""
    if isinstance(data, list | tuple):
        return sum(1 if isinstance(x, torch.Tensor) else _tensors_in(x) for x in data)
    return 0
