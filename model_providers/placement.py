"""Put a built megatron model wholly on one device and in its params dtype, and say what is not.

Megatron allocates linear weights where `TransformerConfig.use_cpu_initialization` says (the current
CUDA device, or the CPU), but not everything a `GPTModel` holds follows that flag: the local spec's
norms (`WrappedTorchNorm` -> `torch.nn.RMSNorm`) are created on the default device in fp32 whatever
the params dtype, and RoPE's `inv_freq` is a plain tensor attribute, which `Module.to` does not
move. Megatron's own training loop hides this with `model.cuda()` plus `Float16Module`; every model
this project builds goes through `place` instead, so the trainer, the converter, `verify`, the
parity worker and the benchmarks all get the same placement.

`misplaced` lists every tensor a module tree holds (parameters, buffers and plain tensor
attributes) that is not where it should be; `place` raises when anything is left over, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with an explicit index for CUDA ("cuda" -> "cuda:<current>"), so comparisons work."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def held_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(qualified name, kind, tensor) for every parameter, buffer and plain tensor attribute."""
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters(recurse=False):
            yield dot + name, "parameter", param
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None:
                yield dot + name, "buffer", buf
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield dot + name, "attribute", value


def misplaced(
    model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype | None = None
) -> list[str]:
    """Descriptions of held tensors off `device`, and of floating parameters not in `dtype`."""
    device = canonical_device(device)
    found = []
    for name, kind, tensor in held_tensors(model):
        if tensor.device != device:
            found.append(f"{kind} {name} on {tensor.device}")
        elif (
            dtype is not None and kind == "parameter" and tensor.is_floating_point() and tensor.dtype != dtype
        ):
            found.append(f"{kind} {name} is {tensor.dtype}")
    return found


@torch.no_grad()
def place(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """Move every parameter, buffer and tensor attribute of `model` to `device`, floating parameters
    and buffers to `dtype` (as megatron's `Float16Module` does); tensor attributes keep their dtype
    (RoPE's `inv_freq` stays fp32). In place: parameter objects are kept, so megatron's attributes
    on them survive. Returns `model`; raises when something stays behind."""
    device = canonical_device(device)
    model.to(device=device, dtype=dtype)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                setattr(module, name, value.to(device))
    left = misplaced(model, device, dtype)
    if left:
        raise RuntimeError(f"model not wholly on {device} in {dtype}: {'; '.join(left[:5])}")
    return model
