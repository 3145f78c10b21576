"""xxh3-128 digests of 16-bit weight tensors and of a whole model.

A tensor digest covers the raw bytes of the full tensor (C order). The model digest covers every
tensor's name, dtype, shape and digest in sorted name order, so it can be recomputed from cached
per-tensor digests without rehashing unchanged weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import xxhash

DIGEST_BYTES = 16


def bits16(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's 16-bit patterns as a flat int16 CPU tensor (shares memory with CPU tensors).

    Torch rather than numpy for whole-tensor passes: its elementwise kernels use every core.
    """
    if tensor.element_size() != 2 or tensor.dtype.is_complex:
        raise ValueError(f"sync handles 16-bit float weights, got {tensor.dtype}")
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.int16)


def bits_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's 16-bit patterns as a flat uint16 numpy array sharing memory (CPU tensors)."""
    return bits16(tensor).numpy().view(np.uint16)


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """xxh3-128 of the tensor's raw bytes."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(bits_view(tensor)).data)


def touched_digest(bits: np.ndarray) -> bytes:
    """xxh3-128 of the uint16 values at a fragment's positions, in ascending position order (the
    digest of a `digest_scope="touched"` fragment: what the receiver must hold there afterwards)."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(bits, dtype="<u2").data)


def model_digest(digests: Mapping[str, bytes], meta: Mapping[str, tuple[str, tuple[int, ...]]]) -> bytes:
    """xxh3-128 over (name, dtype, shape, tensor digest) of every tensor, sorted by name."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        dtype, shape = meta[name]
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode())
        h.update(digests[name])
    return h.digest()


def state_dict_digests(state_dict: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: tensor_digest(t) for name, t in state_dict.items()}


def state_dict_meta(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in state_dict.items()}


DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"sync handles {', '.join(DTYPES)} weights, got {dtype}")
