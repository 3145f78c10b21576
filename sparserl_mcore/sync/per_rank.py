"""Per-rank fragments: every learner rank encodes its OWN changes for each receiver rank; no gather.

A learner rank's changes come from `ShardSyncer.local_changes()` (its owned slice, already in HF
coordinates, with old and new bits from its own snapshot). `split_by_receiver` keeps, for each
rank of a receiver with its own sharding (`SegmentLayout`, e.g. SGLang's TP layout), the changed
elements that rank holds (replicated elements go to every holder); a receiver holding every HF
tensor whole (the embedded engine, `sparserl serve`) gets one fragment. `encode_fragment` writes
a normal format-3 patch with `digest_scope="touched"`: plain positions (no rank holds the whole
base), per tensor the xxh3-128 of the new values at its positions (the receiver checks what it
wrote), and fragment (index, count) = (learner rank, learner ranks) so the receiver knows when
the version is complete (`apply.FragmentLedger`). A full sync is the same with every owned
element and the `overwrite` encoding (base_version None).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.ckpt.layout import SegmentLayout
from sparserl_mcore.sync.codec import CodecConfig, Patch, TensorChange, encode_patch
from sparserl_mcore.sync.hashing import DIGEST_BYTES, touched_digest

# (HF tensor, HF flat indices, old bits or None, new bits)
Change = tuple[str, np.ndarray, np.ndarray | None, np.ndarray]


@dataclass(frozen=True)
class ModelMeta:
    """What every fragment says about the whole model (checked by receivers before writing)."""

    dtype: str
    shapes: Mapping[str, tuple[int, ...]]

    @property
    def tensors(self) -> int:
        return len(self.shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())


def split_by_receiver(changes: Sequence[Change], layout: SegmentLayout | None) -> list[list[Change]]:
    """Changes per receiver rank: all of them for a whole-tensor receiver (`layout` None), else
    the elements each of `layout`'s TP ranks holds (`layout.to_local_index`, pp_rank 0)."""
    if layout is None:
        return [list(changes)]
    out: list[list[Change]] = [[] for _ in range(layout.tp_size)]
    for name, idx, old, new in changes:
        query = torch.from_numpy(idx)
        for rank in range(layout.tp_size):
            held = [pos for _, pos, _ in layout.to_local_index(name, query, rank, 0)]
            if not held:
                continue
            pos = torch.unique(torch.cat(held)).numpy() if len(held) > 1 else held[0].numpy()
            out[rank].append((name, idx[pos], None if old is None else old[pos], new[pos]))
    return out


def encode_fragment(
    changes: Sequence[Change],
    meta: ModelMeta,
    *,
    version: int,
    base_version: int | None,
    fragment: tuple[int, int],
    codec: CodecConfig | None = None,
) -> bytes:
    """One touched-digest fragment; base_version None: a full fragment (overwrite encoding)."""
    per_name: dict[str, list[Change]] = {}
    for change in changes:
        per_name.setdefault(change[0], []).append(change)
    tensors = []
    for name in sorted(per_name):
        parts = per_name[name]
        idx = np.concatenate([p[1] for p in parts]).astype(np.int64, copy=False)
        new = np.concatenate([p[3] for p in parts])
        old = None if any(p[2] is None for p in parts) else np.concatenate([p[2] for p in parts])
        order = np.argsort(idx, kind="stable")
        idx, new = idx[order], new[order]
        if idx.size > 1 and not (np.diff(idx) > 0).all():
            raise RuntimeError(f"{name}: one HF element listed twice in this rank's changes (layout bug)")
        tensors.append(
            TensorChange(
                name=name,
                dtype=meta.dtype,
                shape=tuple(meta.shapes[name]),
                indices=idx,
                new_bits=new,
                old_bits=None if old is None else old[order],
                digest=touched_digest(new),
            )
        )
    patch = Patch(
        version=version,
        base_version=base_version,
        anchor_version=version if base_version is None else base_version,
        model_digest=bytes(DIGEST_BYTES),
        model_tensors=meta.tensors,
        model_numel=meta.numel,
        tensors=tuple(tensors),
        fragment=fragment,
        digest_scope="touched",
    )
    codec = codec or CodecConfig()
    encoding = "overwrite" if base_version is None else codec.encoding
    return encode_patch(patch, dataclasses.replace(codec, position_model="plain", encoding=encoding))
