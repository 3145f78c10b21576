"""The CPU stand-ins for SGLang's CUDA-only packages (`sparserl_mcore.sglang.cpu_stubs`), in a fresh
Python process that gets them the way every SGLang process of `sparserl sglang-serve --device cpu`
does: through `cpu_site/sitecustomize.py` on PYTHONPATH. A kernel reached on CPU must fail with its
name; defining one (what SGLang does at import) must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sparserl_mcore.sglang.launch import CPU_SITE

PROBE = r"""
import json, sys
from sparserl_mcore.sglang import cpu_stubs
out = {"installed": list(cpu_stubs.installed())}

def outcome(call):
    try:
        call()
        return "ok"
    except cpu_stubs.CudaOnlyError as exc:
        return str(exc)

import sgl_kernel, triton, triton.language as tl, torchvision.transforms as T
from sgl_kernel import fused_add_rmsnorm

@triton.jit
def kernel(x, BLOCK: tl.constexpr):
    pass

@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=4)], key=["n"])
@triton.jit
def tuned(x):
    pass

SIZE = tl.constexpr(16)

class Derived(sgl_kernel.SomeBase):  # a class built on a stand-in name at import
    pass

out["defined"] = [type(kernel).__name__, type(tuned).__name__, Derived.__name__]
out["kernel_call"] = outcome(lambda: kernel[(1,)](1))
out["op_call"] = outcome(lambda: fused_add_rmsnorm(1, 2))
out["helper_call"] = outcome(lambda: triton.cdiv(7, 2))
out["driver"] = outcome(lambda: triton.runtime.driver.active)
out["versions"] = [triton.__version__, __import__("torchvision").__version__]
try:
    import triton.knobs
    out["knobs"] = "importable"
except ImportError:
    out["knobs"] = "absent"
print(json.dumps(out))
"""


def _probe() -> dict:
    """PROBE's findings in a fresh process with cpu_site first on PYTHONPATH (as the launcher sets)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([CPU_SITE, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stand_ins_let_kernels_be_defined_and_refuse_every_call_by_name():
    out = _probe()
    assert out["installed"] == ["sgl_kernel", "triton", "torchvision"]  # none is installed here
    assert out["defined"] == ["Kernel", "Kernel", "Derived"]
    assert out["kernel_call"].startswith("triton.jit(kernel): called on a box without CUDA")
    assert out["op_call"].startswith("sgl_kernel.fused_add_rmsnorm: called on a box without CUDA")
    assert out["helper_call"].startswith("triton.cdiv: called")
    assert out["driver"].startswith(
        "triton.runtime.driver.active: called"
    )  # as the wheel raises without a driver
    assert out["versions"] == ["3.5.0", "0.0.0"] and out["knobs"] == "absent"


def test_nothing_is_replaced_where_cuda_is_visible():
    """A GPU box (simulated: `torch.cuda.is_available` answers yes): `install` does nothing."""
    code = (
        "import torch; torch.cuda.is_available = lambda: True;"
        "from sparserl_mcore.sglang import cpu_stubs; print(cpu_stubs.install(), cpu_stubs.installed())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["()", "()"]
