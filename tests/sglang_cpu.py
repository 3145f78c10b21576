"""Import the pinned sglang (0.5.23) on this CPU-only box, the way SGLang's own CPU CI does.

What is stubbed, and why (each stub answers every attribute with a MagicMock, so only code that
is never called may touch it):
- `sgl_kernel`: CUDA kernels; the same mechanism as SGLang's own CPU CI helper
  `sglang/test/test_utils.py: maybe_stub_sgl_kernel` (not imported: that module pulls `datasets`).
- `triton`: imported unconditionally by `sglang.srt.utils.common`; the CPU torch wheel has no
  triton and the real one is ~1 GB. torch's own triton probes (flop counter, inductor) are
  imported first, so torch still sees "no triton" and never calls the stub.
- `torchvision`: only SGLang's multimodal preprocessing imports it; the PyPI build pulls a CUDA torch.
Not importable here even so: `sglang.srt.managers.scheduler` (a MagicMock used as an attribute
name at import) and hence the HTTP server entrypoints; tests needing those say so.
`make setup` installs sglang with --no-deps plus the pure-python modules it imports (Makefile).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from unittest.mock import MagicMock

import pytest

_STUBBED = ("sgl_kernel", "triton", "torchvision")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__getattr__ = lambda name: MagicMock()  # type: ignore[method-assign]


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
        if fullname.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


_ready = False


def require_sglang() -> None:
    """Skip the calling test module when sglang is not installed; else make it importable."""
    global _ready
    if _ready:
        return
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (make setup installs sglang==0.5.23 --no-deps)")
    # SGLang's supported CPU backend: its CPU code paths (rotary embedding, loaders) instead of CUDA's
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import torch._inductor.compile_fx  # noqa: F401 - and here (SGLang calls torch.compile at import)
    import torch.utils.flop_counter  # noqa: F401 - torch probes triton here: before the stub

    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        missing = [m for m in _STUBBED if importlib.util.find_spec(m) is None]
        if missing:
            sys.meta_path.insert(0, _StubFinder())
    _ready = True
