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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.sync.apply import ApplyResult, check_target, gather_bits, scatter_bits
from sparserl_mcore.sync.codec import (
    VALUE_ENCODINGS,
    DecodedTensor,
    PatchError,
    decode_fragments,
    resolve_positions,
)
from sparserl_mcore.sync.hashing import bits_view, dtype_name, model_digest, tensor_digest

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
        layout: ModelLayout,
        shards: Mapping[Shard, Mapping[str, torch.Tensor]],
        *,
        version: int | None = None,
    ) -> None:
        self.layout, self.shards, self.version = layout, shards, version
        for (tp, pp), params in shards.items():
            expected = layout.shard(tp, pp)
            if set(params) != set(expected):
                raise ValueError(
                    f"shard ({tp}, {pp}) params differ from the layout: "
                    f"{sorted(set(params) ^ set(expected))[:4]}"
                )
        self.dtype = next(t.dtype for params in shards.values() for t in params.values())
        holders: dict[str, set[Shard]] = {}
        for tp in range(layout.tp_size):
            for pp in range(layout.pp_size):
                for param in layout.shard(tp, pp).values():
                    for name in param.hf_names if param.emit else ():
                        holders.setdefault(name, set()).add((tp, pp))
        self.covered = {n for n, need in holders.items() if need <= set(shards)}
        self.digests = {n: tensor_digest(self.hf_tensor(n)) for n in sorted(self.covered)}

    def hf_tensor(self, name: str) -> torch.Tensor:
        """Rebuild HF tensor `name` from the held shards (it must be covered)."""
        out = torch.empty(self.layout.hf_shapes[name], dtype=self.dtype)
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
        """Validate, write every held copy, verify covered tensors; PatchError leaves nothing changed."""
        patch = decode_fragments(parts)
        hf_tensors = {name: (shape, self.dtype) for name, shape in self.layout.hf_shapes.items()}
        check_target(patch, hf_tensors, self.version)
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
            meta = {n: (dtype_name(self.dtype), s) for n, s in self.layout.hf_shapes.items()}
            if model_digest(digests, meta) != patch.model_digest:
                bad.append("<whole model>")
        if bad:
            for _, writes, _, old in planned:
                for w, o in zip(writes, old, strict=True):
                    scatter_bits(w.flat, w.index, o)
            raise PatchError(
                f"digest mismatch after applying patch {patch.version} to {bad[:3]}; rolled back"
            )
        self.version, self.digests = patch.version, digests
        return ApplyResult(
            version=patch.version,
            changed_elements=sum(t.stored.size for t in patch.tensors),
            changed_tensors=len(patch.tensors),
            digests=digests,
        )
