"""Apply a patch to an HF-layout state dict in place: validate fully, write, verify, or roll back.

All-or-nothing: the patch is decoded and checked against the target (base version, names, dtypes,
shapes, model size) before any byte is written; after the writes the per-tensor and whole-model
xxh3-128 digests are checked, and on a mismatch every written position gets its old bits back
before `PatchError` is raised. The caller (`HFReceiver`, a transport) then falls back to a full
sync.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.sync.codec import (
    VALUE_ENCODINGS,
    DecodedPatch,
    PatchError,
    decode_fragments,
    resolve_positions,
)
from sparserl_mcore.sync.hashing import (
    DTYPES,
    bits_view,
    model_digest,
    state_dict_digests,
    state_dict_meta,
    tensor_digest,
)


class PatchVersionError(PatchError):
    """The patch was made against another base version than the receiver holds (a missed or
    repeated sync): the receiver needs a full sync, not a retry of this patch."""


def _flat_bits(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise PatchError(f"target tensor {name!r} is not contiguous; cannot patch it in place")
    return tensor.detach().view(-1).view(torch.int16)


def check_target(
    patch: DecodedPatch,
    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    version: int | None,
) -> None:
    """Everything that must hold before writing, against the receiver's HF `{name: (shape, dtype)}`:
    raises PatchError, touches nothing. Shared by the plain and the sharded receiver."""
    if not patch.full and patch.base_version != version:
        raise PatchVersionError(
            f"patch {patch.version} is based on version {patch.base_version}, the receiver holds {version}"
        )
    numel = sum(math.prod(shape) for shape, _ in tensors.values())
    if patch.model_tensors != len(tensors) or patch.model_numel != numel:
        raise PatchError(
            f"patch describes a model of {patch.model_tensors} tensors / {patch.model_numel} elements, "
            f"the receiver has {len(tensors)} / {numel}"
        )
    for t in patch.tensors:
        if t.name not in tensors:
            raise PatchError(f"patch tensor {t.name!r} is unknown to the receiver")
        shape, dtype = tensors[t.name]
        if tuple(shape) != t.shape or dtype != DTYPES[t.dtype]:
            raise PatchError(
                f"patch tensor {t.name!r} is {t.shape} {t.dtype}, the receiver's is {tuple(shape)} {dtype}"
            )


def gather_bits(flat: torch.Tensor, index: np.ndarray | None) -> np.ndarray:
    """uint16 copy of `flat[index]` (all of it for None). CPU goes through numpy: its fancy
    indexing is far faster than torch's int16 index_select/index_copy_ there."""
    if flat.device.type == "cpu":
        bits = flat.numpy().view(np.uint16)
        return bits.copy() if index is None else bits[index]
    picked = flat if index is None else flat.index_select(0, torch.from_numpy(index).to(flat.device))
    return picked.cpu().numpy().view(np.uint16)


def scatter_bits(flat: torch.Tensor, index: np.ndarray | None, values: np.ndarray) -> None:
    """`flat[index] = values` (all of it for None), in place."""
    if flat.device.type == "cpu":
        bits = flat.numpy().view(np.uint16)
        if index is None:
            bits[:] = values
        else:
            bits[index] = values
        return
    src = torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).to(flat.device)
    if index is None:
        flat.copy_(src)
    else:
        flat.index_copy_(0, torch.from_numpy(index).to(flat.device), src)


@dataclass(frozen=True)
class ApplyResult:
    version: int
    changed_elements: int
    changed_tensors: int
    digests: dict[str, bytes]


def apply_decoded(
    state: MutableMapping[str, torch.Tensor],
    patch: DecodedPatch,
    *,
    version: int | None,
    digests: Mapping[str, bytes] | None = None,
) -> ApplyResult:
    """Apply a decoded patch in place; see the module docstring for the all-or-nothing contract."""
    check_target(patch, {name: (tuple(t.shape), t.dtype) for name, t in state.items()}, version)
    patch = resolve_positions(patch, lambda name: bits_view(state[name]))
    digests = dict(digests) if digests is not None else state_dict_digests(state)
    planned = []
    for t in patch.tensors:
        flat = _flat_bits(state[t.name], t.name)
        old = gather_bits(flat, t.indices)
        new = t.stored if t.indices is None else VALUE_ENCODINGS[patch.encoding].apply(old, t.stored)
        planned.append((t, flat, new, old))
    for t, flat, new, _ in planned:
        scatter_bits(flat, t.indices, new)
    new_digests = dict(digests)
    bad = []
    for t, *_ in planned:
        new_digests[t.name] = tensor_digest(state[t.name])
        if new_digests[t.name] != t.digest:
            bad.append(t.name)
    if not bad and model_digest(new_digests, state_dict_meta(state)) != patch.model_digest:
        bad.append("<whole model>")
    if bad:
        for t, flat, _, old in planned:
            scatter_bits(flat, t.indices, old)
        raise PatchError(f"digest mismatch after applying patch {patch.version} to {bad[:3]}; rolled back")
    return ApplyResult(
        version=patch.version,
        changed_elements=sum(t.stored.size for t in patch.tensors),
        changed_tensors=len(patch.tensors),
        digests=new_digests,
    )


def apply_patch(
    state: MutableMapping[str, torch.Tensor],
    data: bytes | list[bytes],
    *,
    version: int | None,
    digests: Mapping[str, bytes] | None = None,
) -> ApplyResult:
    """Decode, validate and apply a patch (or all fragments of one version) to `state` in place.

    This is the in-process API rollout engines call. `version`: what `state` holds now;
    `digests`: cached per-tensor digests of `state` (computed when None). Raises PatchError with
    `state` unchanged.
    """
    return apply_decoded(state, decode_fragments(data), version=version, digests=digests)


class HFReceiver:
    """A receiver over an HF-layout state dict (name -> contiguous 16-bit tensor, any device).

    Keeps the held version and per-tensor digests so a patch rehashes only the tensors it touches.
    """

    def __init__(
        self,
        state: MutableMapping[str, torch.Tensor],
        *,
        version: int | None = None,
        digests: Mapping[str, bytes] | None = None,
    ) -> None:
        """`digests`: per-tensor digests of `state` when already known (else hashed here)."""
        self.state = state
        self.version = version
        self.digests = dict(digests) if digests is not None else state_dict_digests(state)

    def apply(self, data: bytes | list[bytes]) -> ApplyResult:
        result = apply_patch(self.state, data, version=self.version, digests=self.digests)
        self.version, self.digests = result.version, result.digests
        return result

    def model_digest(self) -> bytes:
        return model_digest(self.digests, state_dict_meta(self.state))
