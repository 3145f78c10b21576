"""Apply a patch to an HF-layout state dict in place: validate fully, write, verify, or roll back.

All-or-nothing: the patch is decoded and checked against the target (base version, names, dtypes,
shapes, model size) before any byte is written; after the writes the per-tensor and whole-model
xxh3-128 digests are checked, and on a mismatch every written position gets its old bits back
before `PatchError` is raised. The caller (`HFReceiver`, a transport) then falls back to a full
sync.

Per-rank fragments (`digest_scope="touched"`, made by each learner rank from its own shard) are
applied one at a time: each is checked, written and verified against the digest of the values at
its own positions, and rolled back alone; `FragmentLedger` counts a version's fragments and moves
the receiver to that version when all have landed. A fragment that fails after others of its
version landed leaves the receiver between versions: the ledger then refuses sparse fragments
until a full sync (base None) has completed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.sync.codec import (
    VALUE_ENCODINGS,
    DecodedPatch,
    PatchError,
    decode_patch,
    merge_fragments,
    resolve_positions,
    split_fragments,
)
from sparserl_mcore.sync.hashing import (
    DTYPES,
    bits_view,
    model_digest,
    state_dict_digests,
    state_dict_meta,
    tensor_digest,
    touched_digest,
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
    *,
    check_base: bool = True,
) -> None:
    """Everything that must hold before writing, against the receiver's HF `{name: (shape, dtype)}`:
    raises PatchError, touches nothing. Shared by the plain and the sharded receiver. check_base
    False: the caller's `FragmentLedger` checks the base version."""
    if check_base and not patch.full and patch.base_version != version:
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
    version: int | None  # the receiver's version afterwards (unchanged while a version's fragments arrive)
    changed_elements: int
    changed_tensors: int
    digests: dict[str, bytes]  # whole-tensor digests (tensor-scope patches; {} for touched fragments)
    touched: tuple[str, ...] = ()  # names of the tensors written


def decode_parts(data: bytes | list[bytes]) -> list[DecodedPatch]:
    """The patches to apply in order: one merged patch, or each touched-scope fragment alone."""
    parts = split_fragments(bytes(data)) if isinstance(data, bytes | bytearray | memoryview) else data
    decoded = [decode_patch(p) for p in parts or [b""]]
    if all(d.digest_scope == "tensor" for d in decoded):
        return [merge_fragments(decoded)]
    return decoded


class FragmentLedger:
    """The version a receiver holds, advanced fragment by fragment (touched-scope fragments).

    A version's fragments carry (index, count); the version is reached when all `count` landed.
    `broken`: why sparse fragments are refused until a full sync (base_version None) completes.
    """

    def __init__(self, version: int | None) -> None:
        self.version = version
        self.pending: tuple[int, int | None, int] | None = None  # (version, base, count)
        self.landed: set[int] = set()
        self.broken: str | None = None

    def check(self, patch: DecodedPatch) -> None:
        """Raise PatchError (nothing changes) unless `patch` may be applied now."""
        index, count = patch.fragment
        if self.pending is None:
            if self.broken is not None and patch.base_version is not None:
                raise PatchError(f"receiver needs a full sync first ({self.broken})")
            if patch.base_version is not None and patch.base_version != self.version:
                raise PatchVersionError(
                    f"patch {patch.version} is based on version {patch.base_version}, the receiver holds "
                    f"{self.version}"
                )
            return
        if (patch.version, patch.base_version, count) != self.pending:
            raise PatchError(
                f"fragment of version {patch.version} (base {patch.base_version}, {count} fragments) arrived "
                f"while version {self.pending[0]} has {len(self.landed)}/{self.pending[2]} fragments applied"
            )
        if index in self.landed:
            raise PatchError(f"fragment {index}/{count} of version {patch.version} was already applied")

    def landed_one(self, patch: DecodedPatch) -> None:
        index, count = patch.fragment
        if self.pending is None:
            self.pending = (patch.version, patch.base_version, count)
        self.landed.add(index)
        if len(self.landed) == count:
            if patch.base_version is None:
                self.broken = None
            self.version, self.pending, self.landed = patch.version, None, set()

    def failed(self, reason: str) -> None:
        if self.pending is not None:  # other fragments of this version already landed
            self.broken = reason
            self.pending, self.landed = None, set()


def apply_decoded(
    state: MutableMapping[str, torch.Tensor],
    patch: DecodedPatch,
    *,
    version: int | None,
    digests: Mapping[str, bytes] | None = None,
) -> ApplyResult:
    """Apply a decoded patch in place; see the module docstring for the all-or-nothing contract."""
    if patch.digest_scope == "touched":
        return _apply_touched(state, patch, version=version)
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
        touched=tuple(t.name for t in patch.tensors),
    )


def _apply_touched(
    state: MutableMapping[str, torch.Tensor], patch: DecodedPatch, *, version: int | None
) -> ApplyResult:
    """One touched-scope fragment: its base version is the ledger's business (`version` None here
    skips that check); verified by the digest of the values at its own positions."""
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    check_target(patch, shapes, version, check_base=version is not None)
    patch = resolve_positions(patch, lambda name: bits_view(state[name]))
    planned = []
    for t in patch.tensors:
        flat = _flat_bits(state[t.name], t.name)
        old = gather_bits(flat, t.indices)
        new = (
            t.stored
            if not VALUE_ENCODINGS[patch.encoding].needs_base
            else (VALUE_ENCODINGS[patch.encoding].apply(old, t.stored))
        )
        planned.append((t, flat, old))
        scatter_bits(flat, t.indices, new)
    bad = [t.name for t, flat, _ in planned if touched_digest(gather_bits(flat, t.indices)) != t.digest]
    if bad:
        for t, flat, old in planned:
            scatter_bits(flat, t.indices, old)
        raise PatchError(
            f"digest mismatch after applying fragment {patch.fragment} of {patch.version} to {bad[:3]}"
        )
    return ApplyResult(
        version=patch.version,
        changed_elements=sum(t.stored.size for t in patch.tensors),
        changed_tensors=len(patch.tensors),
        digests={},
        touched=tuple(t.name for t in patch.tensors),
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
    (patch,) = decode_parts(data) if not isinstance(data, DecodedPatch) else (data,)
    if patch.digest_scope != "tensor":
        raise PatchError("touched-digest fragments need a receiver that counts fragments (HFReceiver)")
    return apply_decoded(state, patch, version=version, digests=digests)


class HFReceiver:
    """A receiver over an HF-layout state dict (name -> contiguous 16-bit tensor, any device).

    Keeps the held version and per-tensor digests so a patch rehashes only the tensors it touches
    (tensors written by touched-scope fragments are rehashed when a whole-tensor patch needs them).
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
        self.ledger = FragmentLedger(version)
        self.digests = dict(digests) if digests is not None else state_dict_digests(state)
        self._stale: set[str] = set()

    @property
    def version(self) -> int | None:
        return self.ledger.version

    def apply(self, data: bytes | list[bytes]) -> ApplyResult:
        """A whole patch (all-or-nothing), or touched-scope fragments one by one (each all-or-nothing).

        The result covers every part applied: per-rank fragments (one per learner rank) write
        disjoint tensors under PP, and a caller refreshing what changed needs all of them.
        """
        return self.apply_decoded(decode_parts(data))

    def apply_decoded(self, parts: list[DecodedPatch]) -> ApplyResult:
        """`apply` of patches already decoded (`decode_parts`): an engine decodes while it keeps
        generating and holds generation only for this part."""
        results = [self._apply_one(patch) for patch in parts]
        if len(results) == 1:
            return results[0]
        touched = tuple(dict.fromkeys(name for r in results for name in r.touched))
        return dataclasses.replace(
            results[-1],
            changed_elements=sum(r.changed_elements for r in results),
            changed_tensors=len(touched),
            touched=touched,
        )

    def _apply_one(self, patch: DecodedPatch) -> ApplyResult:
        if patch.digest_scope == "touched":
            self.ledger.check(patch)
            try:
                result = _apply_touched(self.state, patch, version=None)
            except PatchError as exc:
                self.ledger.failed(str(exc))
                raise
            self.ledger.landed_one(patch)
            self._stale.update(result.touched)
            return dataclasses.replace(result, version=self.ledger.version)
        if (self.ledger.pending is not None or self.ledger.broken is not None) and not patch.full:
            raise PatchError(f"receiver is between versions ({self.ledger.broken or 'fragments pending'})")
        for name in self._stale:
            self.digests[name] = tensor_digest(self.state[name])
        self._stale.clear()
        result = apply_decoded(self.state, patch, version=self.ledger.version, digests=self.digests)
        self.ledger = FragmentLedger(result.version)
        self.digests = result.digests
        return result

    def model_digest(self) -> bytes:
        for name in self._stale:
            self.digests[name] = tensor_digest(self.state[name])
        self._stale.clear()
        return model_digest(self.digests, state_dict_meta(self.state))
