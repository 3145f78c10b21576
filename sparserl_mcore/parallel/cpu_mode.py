"""CPU execution mode: lets unmodified megatron-core run on CPU processes over gloo.

This is the ONE place in the project that bends megatron-core to a machine without a GPU. It is used
for tests, the demo and CPU learners; `parallel.initialize` enters it only when no GPU is used and
`enable()` refuses to run when CUDA is available, so GPU runs never see any of it.

What it changes while active, and why (megatron-core 0.16.x hard-codes CUDA in these places):

1. A `torch.overrides.TorchFunctionMode` rewrites device arguments that name CUDA (`"cuda"`,
   `"cuda:N"`, a CUDA `torch.device`, or a bare int index) to CPU on every torch call, makes
   `Tensor.cuda()` return the tensor itself, and turns `pin_memory=True` off. Megatron allocates
   pipeline/TP communication buffers, the attention memory buffer and token counters with
   `device=torch.cuda.current_device()` or `device="cuda"`.
2. `torch.cuda.current_device` returns 0 and `torch.cuda.synchronize` is a no-op (p2p communication
   calls both). The originals are restored by `disable()`.
3. Megatron's CUDA RNG state tracker is replaced by `CpuRNGStatesTracker`, which keeps one torch CPU
   generator state per tracker name and swaps it into the default CPU generator inside `fork(name)`,
   exactly as megatron swaps CUDA generator states. Dropout inside TP regions therefore draws from
   the per-TP-rank "model-parallel-rng" stream and advances it, as on GPU; it is not a no-op.
   `model_parallel_cuda_manual_seed` keeps working unchanged because it only talks to the tracker.
4. `Tensor.type()` without arguments reports the CUDA type name of a CPU tensor
   (`torch.BFloat16Tensor` -> `torch.cuda.BFloat16Tensor`, likewise Float/Half). Megatron's
   mixed-precision optimizers (`Float16OptimizerWithFloat16Params`, `DistributedOptimizer`) and
   `clip_grad_by_total_norm_fp32` use these strings only as dtype checks and reject CPU names, so
   without this bf16 params + fp32 master weights and the distributed optimizer cannot be built on
   CPU. `Tensor.type(dtype)` (a conversion) is untouched; everything else these paths need on CPU
   (`device="cuda"` buffers, the local multi-tensor fallbacks) is covered by point 1.

Mixture-of-experts layers (megatron's MoE with expert parallelism, measured in
`../shared/research/moe-on-cpu.md`) reach four more CUDA-only spots, also changed while active:

5. Torch function modes are not active inside autograd backward, so the backward of megatron's
   communication functions (`tensor_parallel/mappings.py`: the sequence-parallel gathers and
   reduce-scatters MoE training with TP > 1 needs) would allocate on `torch.cuda.current_device()`
   and fail. `BackwardCFunction.apply`, through which the autograd engine runs every custom
   Function's backward, re-enters the device rewrite of point 1.
6. `torch.cuda.Stream` / `current_stream` / `stream` / `Event` become no-op stand-ins: the
   all-to-all token dispatcher moves its split sizes to the host on a side stream
   (`moe/token_dispatcher.py: _maybe_dtoh_and_synchronize`); on CPU there is one stream.
7. The dispatcher's `maybe_move_tensor_to_cpu(..., as_numpy=True)` converts only CUDA tensors, so on
   CPU the split sizes would reach `all_to_all_single` as tensors (a TypeError); the stand-in
   returns them as numpy arrays as it does on GPU.
8. gloo refuses `all_gather` into tensors of unequal sizes and has no list `reduce_scatter`, which
   megatron's `mappings._gather_along_first_dim` / `_reduce_scatter_along_first_dim` use with split
   sizes (the all-to-all dispatcher's token exchange over TP); the stand-ins pad to the largest
   split, gather and cut (resp. all-reduce and keep their own split): the same numbers.

Not changed: kernels and fusions. Models built for CPU must turn fusions off and use the SDPA core
attention of `model_providers` (see `model_providers.layer_specs`).

Usage: `with cpu_mode.CPUExecutionMode(): ...` or `cpu_mode.enable()` / `cpu_mode.disable()` (what
`parallel.initialize` / `parallel.shutdown` do). The TorchFunctionMode is per thread: megatron
work must run on the thread that entered the mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to CPU and reports CUDA type names (points 1
    and 4 of the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(args[0])
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if kwargs and (_is_cuda_device(kwargs.get("device")) or kwargs.get("pin_memory")):
            kwargs = dict(kwargs)
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **(kwargs or {}))


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG tracker, keeping torch CPU generator states instead of CUDA ones.

    `fork(name)` swaps the named state into the default CPU generator, runs the block, stores the
    advanced state back under `name` and restores the caller's state, so named streams are
    reproducible and independent of the default stream (point 3 of the module docstring).
    """

    _current_state_name: str  # set by megatron's tracker (untyped to mypy)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another tracker state")
        if name in self.states_:
            raise ValueError(f"RNG tracker state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG tracker state {name!r} was never added; known: {sorted(self.states_)}")
        caller_state = torch.get_rng_state()
        caller_name = self._current_state_name
        if caller_name != "default-rng":
            self.states_[caller_name] = caller_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if caller_name != "default-rng":
                caller_state = self.states_[caller_name]
            torch.set_rng_state(caller_state)
            self._current_state_name = caller_name


class _CpuStream:
    """One CPU stream: every stream operation is immediate (point 6). A class, not a function:
    code imported while the mode is active may use `torch.cuda.Stream` in annotations."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def record_event(self, event: object = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


class _CpuEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


def _host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host (point 7)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _gather_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """`mappings._gather_along_first_dim` over gloo, unequal splits included (point 8)."""
    import torch.distributed as dist

    world = group.size()
    if world == 1:
        return input_
    sizes = list(output_split_sizes) if output_split_sizes is not None else [input_.shape[0]] * world
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _reduce_scatter_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """`mappings._reduce_scatter_along_first_dim` over gloo (point 8): all-reduce, keep own split."""
    import torch.distributed as dist

    world = group.size()
    if world == 1:
        return input_
    if input_split_sizes is None:
        if input_.shape[0] % world:
            raise ValueError(f"first dimension {input_.shape[0]} is not divisible by the group size {world}")
        input_split_sizes = [input_.shape[0] // world] * world
    total = input_.clone()
    dist.all_reduce(total, group=group)
    start = sum(input_split_sizes[: group.rank()])
    return total[start : start + input_split_sizes[group.rank()]].contiguous()


class CPUExecutionMode:
    """Context manager applying the changes of the module docstring; reverts them on exit."""

    def __init__(self) -> None:
        self._mode: _CudaToCpu | None = None
        self._saved: dict[str, Any] = {}
        self._originals: dict[tuple[Any, str], Any] = {}

    def __enter__(self) -> CPUExecutionMode:
        if torch.cuda.is_available():
            raise RuntimeError("the CPU execution mode must not be used when CUDA is available")
        if self._mode is not None:
            raise RuntimeError("this CPUExecutionMode is already active")
        self._saved = {
            "current_device": torch.cuda.current_device,
            "synchronize": torch.cuda.synchronize,
            "tracker": mcore_random._CUDA_RNG_STATE_TRACKER,
            "tracker_initialized": mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        }
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda device=None: None
        mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        self._swap(_replacements())
        self._mode = _CudaToCpu()
        self._mode.__enter__()
        return self

    def _swap(self, replacements: dict[tuple[Any, str], Any]) -> None:
        """Set each (owner, attribute) to its stand-in, remembering the original (points 5-8)."""
        self._originals = {key: getattr(*key) for key in replacements}
        for (owner, name), value in replacements.items():
            setattr(owner, name, value)

    def __exit__(self, *exc_info: object) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        for (owner, name), value in self._originals.items():
            setattr(owner, name, value)
        torch.cuda.current_device = self._saved["current_device"]
        torch.cuda.synchronize = self._saved["synchronize"]
        mcore_random._CUDA_RNG_STATE_TRACKER = self._saved["tracker"]
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = self._saved["tracker_initialized"]


def _replacements() -> dict[tuple[Any, str], Any]:
    """The stand-ins of points 5-8, keyed by (module or class, attribute)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    backward_apply = BackwardCFunction.apply

    def apply_on_cpu(self: Any, *args: Any) -> Any:
        with _CudaToCpu():
            return backward_apply(self, *args)

    return {
        (BackwardCFunction, "apply"): apply_on_cpu,
        (torch.cuda, "Stream"): _CpuStream,
        (torch.cuda, "current_stream"): lambda device=None: _CURRENT_STREAM,
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "Event"): _CpuEvent,
        (token_dispatcher, "maybe_move_tensor_to_cpu"): _host_splits,
        (mappings, "_gather_along_first_dim"): _gather_first_dim,
        (mappings, "_reduce_scatter_along_first_dim"): _reduce_scatter_first_dim,
    }


_active: CPUExecutionMode | None = None


def enable() -> None:
    """Enter the CPU execution mode for the rest of the process (until `disable()`)."""
    global _active
    if _active is None:
        mode = CPUExecutionMode()
        mode.__enter__()
        _active = mode


def disable() -> None:
    """Leave the mode entered by `enable()`; a no-op when it is not active."""
    global _active
    if _active is not None:
        _active.__exit__(None, None, None)
        _active = None


def is_enabled() -> bool:
    return _active is not None
