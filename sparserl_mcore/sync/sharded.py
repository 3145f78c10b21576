"""A receiver whose weights are Megatron-layout TP/PP shards with its OWN sharding.

HF coordinates in a patch become local positions through `ckpt.layout.to_local_index` (every copy
a shard holds: QKV interleave, gate/up halves, partition dims, replicas, tied copies). Same
all-or-nothing contract as `apply.apply_decoded`: check, write, verify, roll back. The xxh3-128
digests name whole HF tensors, so they are checked for the tensors whose every shard this receiver
holds (rebuilt through `layout.hf_pieces`); a receiver holding only part of a tensor reports it as
unverified and leaves the check to whoever holds the rest. For the same reason such a receiver
cannot decode positions coded against the base (format 3's `base` position model): its sender must
encode with `CodecConfig(position_model="plain")`, else the patch is rejected (PatchError, nothing
written) and the transport falls back to a dense sync.

Per-rank fragments (`digest_scope="touched"`, `sync.per_rank`) need no whole tensor: each is
written and verified against the digest of the values at its own positions, on every copy this
receiver holds, and rolled back alone; `apply.FragmentLedger` tracks the version. This is how
one SGLang TP worker applies patches (`sparserl_mcore.sglang.loader`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.ckpt.layout import SegmentLayout
from sparserl_mcore.sync.apply import (
    ApplyResult,
    FragmentLedger,
    check_target,
    decode_parts,
    gather_bits,
    scatter_bits,
)
from sparserl_mcore.sync.codec import (
    VALUE_ENCODINGS,
    DecodedPatch,
    DecodedTensor,
    PatchError,
    resolve_positions,
)
from sparserl_mcore.sync.hashing import (
    DTYPES,
    bits_view,
    dtype_name,
    model_digest,
    tensor_digest,
    touched_digest,
)

Shard = tuple[int, int]  # (tp_rank, pp_rank)


@dataclass(frozen=True)
class _Write:
    flat: torch.Tensor  # int16 view of a local param
    index: np.ndarray  # local flat positions
    positions: np.ndarray  # positions into the patch tensor's index list


class ShardedReceiver:
    """Holds `shards[(tp_rank, pp_rank)] = {mcore_name: tensor}` of `layout` (any subset of shards)."""

    def __init__(
        self,
        layout: SegmentLayout,
        shards: Mapping[Shard, Mapping[str, torch.Tensor]],
        *,
        version: int | None = None,
    ) -> None:
        self.layout, self.shards, self.ledger = layout, shards, FragmentLedger(version)
        for (tp, pp), params in shards.items():
            expected = layout.shard(tp, pp)
            if set(params) != set(expected):
                raise ValueError(
                    f"shard ({tp}, {pp}) params differ from the layout: "
                    f"{sorted(set(params) ^ set(expected))[:4]}"
                )
        # HF tensor -> the held params (shard, name) that hold pieces of it: each is checked for the
        # patch's dtype (a server may hold some weights in another dtype than the rest)
        self._params_of: dict[str, list[tuple[Shard, str]]] = {}
        for shard in shards:
            for param in layout.shard(*shard).values():
                for name in param.hf_names:
                    self._params_of.setdefault(name, []).append((shard, param.name))
        holders: dict[str, set[Shard]] = {}
        for tp in range(layout.tp_size):
            for pp in range(layout.pp_size):
                for param in layout.shard(tp, pp).values():
                    for name in param.hf_names if param.emit else ():
                        holders.setdefault(name, set()).add((tp, pp))
        self.covered = {n for n, need in holders.items() if need <= set(shards)}
        self._digests: dict[str, bytes] | None = None  # of covered tensors, for whole-tensor patches

    @property
    def version(self) -> int | None:
        return self.ledger.version

    @property
    def digests(self) -> dict[str, bytes]:
        """Whole-tensor digests of the covered tensors (hashed on first use, then kept current)."""
        if self._digests is None:
            self._digests = {n: tensor_digest(self.hf_tensor(n)) for n in sorted(self.covered)}
        return self._digests

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype the receiver holds HF tensor `name` in (that of the first param holding it)."""
        shard, param = self._params_of[name][0]
        return self.shards[shard][param].dtype

    def _hf_targets(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{HF name: (shape, dtype held)} of the whole model; tensors held on no shard here take
        the dtype of the first held param."""
        first = next(t.dtype for params in self.shards.values() for t in params.values())
        return {
            n: (shape, self.dtype_of(n) if n in self._params_of else first)
            for n, shape in self.layout.hf_shapes.items()
        }

    def check_dtypes(self, patch: DecodedPatch) -> None:
        """Every held param a patch tensor writes into must be of the patch's dtype: a 16-bit view
        of another dtype would write the wrong elements. PatchError, in one line, otherwise."""
        for t in patch.tensors:
            want = DTYPES[t.dtype]
            for shard, param in self._params_of.get(t.name, ()):
                have = self.shards[shard][param].dtype
                if have != want:
                    raise PatchError(
                        f"parameter {param!r} (holding {t.name!r}) is {have}, the patch carries {want}: "
                        f"serve the model in {t.dtype} (SGLang's --dtype {t.dtype}) or sync in {have}"
                    )

    def hf_tensor(self, name: str) -> torch.Tensor:
        """Rebuild HF tensor `name` from the held shards (it must be covered)."""
        out = torch.empty(self.layout.hf_shapes[name], dtype=self.dtype_of(name))
        for (tp, pp), params in self.shards.items():
            for param in self.layout.shard(tp, pp).values():
                if name in param.hf_names:
                    for hf_name, rows, cols, view in self.layout.hf_pieces(param, params[param.name]):
                        if hf_name == name:
                            (out[rows] if cols is None else out[rows, cols]).copy_(view)
        return out

    def _base_bits(self, name: str) -> np.ndarray:
        """Whole-tensor base bits for positions coded against the base: only covered tensors have them."""
        if name not in self.covered:
            raise PatchError(
                f"tensor {name!r}: positions are coded against its base values, but this receiver holds "
                "only part of it; encode for partial receivers with CodecConfig(position_model='plain')"
            )
        return bits_view(self.hf_tensor(name))

    def _plan(self, t: DecodedTensor) -> list[_Write]:
        idx = torch.from_numpy(t.indices) if t.indices is not None else torch.arange(int(np.prod(t.shape)))
        writes = []
        for (tp, pp), params in self.shards.items():
            for name, pos, local in self.layout.to_local_index(t.name, idx, tp, pp):
                flat = params[name].detach().view(-1).view(torch.int16)
                writes.append(_Write(flat, local.numpy(), pos.numpy()))
        return writes

    def _new_bits(self, t: DecodedTensor, writes: list[_Write], encoding: str) -> np.ndarray:
        if t.indices is None or not VALUE_ENCODINGS[encoding].needs_base:
            return t.stored
        old = np.zeros(t.stored.size, np.uint16)
        for w in writes:
            old[w.positions] = gather_bits(w.flat, w.index)
        return VALUE_ENCODINGS[encoding].apply(old, t.stored)

    def apply(self, parts: bytes | list[bytes]) -> ApplyResult:
        """A whole patch, or touched-scope fragments one by one; PatchError: that one changed nothing."""
        result = None
        for patch in decode_parts(parts):
            result = (
                self._apply_touched(patch) if patch.digest_scope == "touched" else self._apply_whole(patch)
            )
        assert result is not None
        return result

    def _apply_touched(self, patch: DecodedPatch) -> ApplyResult:
        self.ledger.check(patch)
        try:
            result = self._write_touched(patch)
        except PatchError as exc:
            self.ledger.failed(str(exc))
            raise
        self.ledger.landed_one(patch)
        self._digests = None  # whole-tensor digests are rehashed if a whole-tensor patch comes
        return dataclasses.replace(result, version=self.ledger.version)

    def _write_touched(self, patch: DecodedPatch) -> ApplyResult:
        self.check_dtypes(patch)
        check_target(patch, self._hf_targets(), None, check_base=False)  # the ledger checked the base
        planned = []
        for t in patch.tensors:
            if t.indices is None:
                raise PatchError(f"tensor {t.name!r}: a per-rank fragment must list its positions")
            writes = self._plan(t)
            held = np.zeros(t.stored.size, bool)
            for w in writes:
                held[w.positions] = True
            if not held.all():
                raise PatchError(
                    f"tensor {t.name!r}: the fragment lists {int((~held).sum())} elements "
                    "this receiver does not hold"
                )
            new = self._new_bits(t, writes, patch.encoding)
            planned.append((t, writes, new, [gather_bits(w.flat, w.index) for w in writes]))
        for _, writes, new, _ in planned:
            for w in writes:
                scatter_bits(w.flat, w.index, new[w.positions])
        bad = [t.name for t, writes, _, _ in planned if not _copies_match(t, writes)]
        if bad:
            for _, writes, _, old in planned:
                for w, o in zip(writes, old, strict=True):
                    scatter_bits(w.flat, w.index, o)
            raise PatchError(
                f"digest mismatch after applying fragment {patch.fragment} of {patch.version} "
                f"to {bad[:3]}; rolled back"
            )
        return ApplyResult(
            version=patch.version,
            changed_elements=sum(t.stored.size for t in patch.tensors),
            changed_tensors=len(patch.tensors),
            digests={},
            touched=tuple(t.name for t in patch.tensors),
        )

    def _apply_whole(self, patch: DecodedPatch) -> ApplyResult:
        """Validate, write every held copy, verify covered tensors; PatchError leaves nothing changed."""
        if (self.ledger.pending is not None or self.ledger.broken is not None) and not patch.full:
            raise PatchError(f"receiver is between versions ({self.ledger.broken or 'fragments pending'})")
        self.check_dtypes(patch)
        check_target(patch, self._hf_targets(), self.ledger.version)
        patch = resolve_positions(patch, self._base_bits)
        planned = []
        for t in patch.tensors:
            writes = self._plan(t)
            new = self._new_bits(t, writes, patch.encoding)
            planned.append((t, writes, new, [gather_bits(w.flat, w.index) for w in writes]))
        for _, writes, new, _ in planned:
            for w in writes:
                scatter_bits(w.flat, w.index, new[w.positions])
        digests, bad = dict(self.digests), []
        for t, *_ in planned:
            if t.name in self.covered:
                digests[t.name] = tensor_digest(self.hf_tensor(t.name))
                if digests[t.name] != t.digest:
                    bad.append(t.name)
        if not bad and len(self.covered) == len(self.layout.hf_shapes):
            meta = {n: (dtype_name(self.dtype_of(n)), s) for n, s in self.layout.hf_shapes.items()}
            if model_digest(digests, meta) != patch.model_digest:
                bad.append("<whole model>")
        if bad:
            for _, writes, _, old in planned:
                for w, o in zip(writes, old, strict=True):
                    scatter_bits(w.flat, w.index, o)
            raise PatchError(
                f"digest mismatch after applying patch {patch.version} to {bad[:3]}; rolled back"
            )
        self.ledger, self._digests = FragmentLedger(patch.version), digests
        return ApplyResult(
            version=patch.version,
            changed_elements=sum(t.stored.size for t in patch.tensors),
            changed_tensors=len(patch.tensors),
            digests=digests,
            touched=tuple(t.name for t in patch.tensors),
        )


def _copies_match(t: DecodedTensor, writes: list[_Write]) -> bool:
    """The values now held at the fragment's positions hash to its digest, on every held copy."""
    got = np.zeros(t.stored.size, np.uint16)
    for w in writes:
        got[w.positions] = gather_bits(w.flat, w.index)
    if touched_digest(got) != t.digest:
        return False
    return all(np.array_equal(gather_bits(w.flat, w.index), got[w.positions]) for w in writes)
