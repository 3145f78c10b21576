"""Import-time stand-ins for SGLang's CUDA-only packages, so SGLang 0.5.23 runs on a CPU-only box.

SGLang imports `sgl_kernel` (CUDA / AMX kernels), `triton` (GPU kernels, decorated at import) and
`torchvision` (multimodal preprocessing) at module level even where its CPU engine never calls
them. On a box without them (`install` replaces only a package that is NOT installed, and
nothing at all where CUDA is visible) each becomes a stand-in module that:
- imports, and answers attribute access with more stand-ins (`from sgl_kernel import x` works);
- lets a kernel be *defined*: `triton.jit` / `triton.autotune` / `triton.heuristics` (bare or with
  arguments) and `triton.Config` may be called, so `@triton.jit def k(...)` imports;
- raises `CudaOnlyError` naming the dotted path on any other call, on launching a defined kernel
  (`k[grid](...)`), and on `triton.runtime.driver.active` (what the real wheel raises without a
  driver; SGLang's fla utils probe it at import inside try/except). So a CUDA kernel reached on CPU
  fails loudly with its name instead of doing nothing, which a MagicMock would.
`triton.__version__` is a real version string (modules parse it at import).

Why SGLang's CPU layers never reach them: each CPU layer (RMSNorm, SiluAndMul, rotary, linear,
vocab embedding, logits) calls an `sgl_kernel` op only when `cpu_has_amx_support()`, which needs
`torch.ops.sgl_kernel.convert_weight_packed` registered (it is not, with the stand-in); otherwise
it runs `forward_native`. Attention is torch SDPA (`--attention-backend torch_native`), sampling
PyTorch (`--sampling-backend pytorch`). docs/sglang.md, "A CPU SGLang server".

Installed in every SGLang process by `sparserl_mcore/sglang/cpu_site/sitecustomize.py`, which
`sparserl sglang-serve --device cpu` puts on PYTHONPATH (the launcher, tokenizer manager, spawned
scheduler and detokenizer each import it at start-up). Tests that import SGLang in-process call
`install` themselves (tests/sglang_cpu.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

STUBBED = ("sgl_kernel", "triton", "torchvision")
# Real version strings: SGLang parses triton's at import (mamba, fla, moe configs); transformers
# parses torchvision's when it finds the module (image processors), so 0.0.0 = "too old to use".
VERSIONS = {"triton": "3.5.0", "torchvision": "0.0.0"}
# Names that are called while a kernel is defined, at import: allowed, they return stand-ins.
DEFINING = frozenset(
    {"triton.jit", "triton.autotune", "triton.heuristics", "triton.Config", "triton.language.constexpr"}
)
_DRIVER = "triton.runtime.driver.active"
# Not there at all (ImportError / AttributeError): SGLang probes them and skips what they serve
# (`utils/triton_load_watch.py`: Triton's kernel-load hooks, installed when the scheduler starts).
ABSENT = frozenset({"triton.knobs"})


class CudaOnlyError(RuntimeError):
    """A CUDA-only package was called into on a box that does not have it."""


def _refuse(path: str) -> CudaOnlyError:
    return CudaOnlyError(
        f"{path}: called on a box without CUDA ({path.split('.')[0]} is a CPU stand-in, "
        "sparserl_mcore/sglang/cpu_stubs.py); this SGLang code path needs a GPU"
    )


class Missing:
    """A name inside a stand-in package: any attribute is another one, a call raises."""

    __slots__ = ("_path",)

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        path = f"{self._path}.{name}"
        if path == _DRIVER:
            raise _refuse(path)
        if path in ABSENT:
            raise AttributeError(f"stand-in {self._path} has no {name}")
        return Missing(path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._path not in DEFINING:
            raise _refuse(self._path)
        if len(args) == 1 and callable(args[0]) and not kwargs:  # bare decorator: @triton.jit
            return Kernel(f"{self._path}({getattr(args[0], '__qualname__', '?')})")
        return Decorator(self._path)  # @triton.autotune(configs=..., key=...), triton.Config(...)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        """`class X(sgl_kernel.Something):` defines a class; using it raises (its methods are missing)."""
        return (_Base,)

    def __repr__(self) -> str:
        return f"<CPU stand-in {self._path}>"


class _Base:
    """Base class for classes derived from a stand-in name (defined at import, never used on CPU)."""


class Decorator(Missing):
    """What a kernel-defining call returns: applied to a function, it gives a `Kernel`."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return Kernel(f"{self._path}({getattr(args[0], '__qualname__', '?')})")
        raise _refuse(self._path)


class Kernel(Missing):
    """A defined GPU kernel: launching it (`k[grid](...)`) or calling it raises."""

    __slots__ = ()

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            raise _refuse(self._path)

        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # stacked decorators
            return Kernel(f"{self._path}({getattr(args[0], '__qualname__', '?')})")
        raise _refuse(self._path)


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        path = module.__name__
        if path in VERSIONS:
            module.__version__ = VERSIONS[path]  # type: ignore[attr-defined]

        def attribute(name: str) -> Any:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            return getattr(Missing(path), name)

        module.__getattr__ = attribute  # type: ignore[method-assign]


class StandInFinder(importlib.abc.MetaPathFinder):
    """Answers `import <stubbed>[.sub]` with stand-in modules for the packages in `names`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.names and fullname not in ABSENT:
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)
        return None


def installed() -> tuple[str, ...]:
    """The packages this process answers with stand-ins (empty when `install` did nothing)."""
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder):
            return finder.names
    return ()


def install() -> tuple[str, ...]:
    """Stand-ins for the CUDA-only packages this CPU box lacks; none where CUDA is visible.

    Returns the packages replaced. torch's own triton probes (its flop counter, inductor) are
    imported first, so torch records "no triton" and never calls the stand-in."""
    if installed():
        return installed()
    import torch

    if torch.cuda.is_available():
        return ()
    import torch._inductor.compile_fx  # noqa: F401 - SGLang calls torch.compile at import
    import torch.utils.flop_counter  # noqa: F401 - torch probes triton here: before the stand-in

    missing = tuple(name for name in STUBBED if importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.insert(0, StandInFinder(missing))
    return missing
