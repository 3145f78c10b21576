"""Import the pinned sglang (0.5.23) in a test process on this CPU-only box.

The CUDA-only packages SGLang imports (`sgl_kernel`, `triton`, `torchvision`) are answered by the
same stand-ins a CPU server gets (`sparserl_mcore.sglang.cpu_stubs`): importable, usable to
define kernels, raising `CudaOnlyError` when anything calls into them, so a test that reaches a
CUDA kernel fails with its name. `SGLANG_USE_CPU_ENGINE=1` selects SGLang's CPU code paths.
`make setup` installs sglang with --no-deps plus the pure-python modules it imports (Makefile).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_ready = False


def require_sglang() -> None:
    """Skip the calling test module when sglang is not installed; else make it importable."""
    global _ready
    if _ready:
        return
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (make setup installs sglang==0.5.23 --no-deps)")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sparserl_mcore.sglang import cpu_stubs

    cpu_stubs.install()
    _ready = True
