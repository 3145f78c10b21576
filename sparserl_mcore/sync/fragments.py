"""A version's patch may travel as several fragments (one per PP stage, `Patch.fragment`): cut a
concatenation into fragments, decode and merge them, and summarise a patch (`sparserl sync inspect`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparserl_mcore.sync.decode import decode_patch, read_header
from sparserl_mcore.sync.hashing import DIGEST_BYTES
from sparserl_mcore.sync.patch_format import COMPRESSIONS, FORMAT_VERSION, PREFIX, DecodedPatch, PatchError


def merge_fragments(fragments: list[DecodedPatch]) -> DecodedPatch:
    """Join the fragments of one version into one patch; every fragment exactly once, names disjoint."""
    if not fragments:
        raise PatchError("no patch fragments given")
    if any(f.digest_scope != "tensor" for f in fragments):
        raise PatchError("fragments with touched digests are applied one by one, not merged")
    first = fragments[0]
    count = first.fragment[1]
    if sorted(f.fragment[0] for f in fragments) != list(range(count)) or any(
        f.fragment[1] != count for f in fragments
    ):
        raise PatchError(
            f"patch fragments {[f.fragment for f in fragments]} are not a complete set of {count}"
        )
    same = (
        "version",
        "base_version",
        "anchor_version",
        "encoding",
        "model_digest",
        "model_tensors",
        "model_numel",
    )
    for f in fragments[1:]:
        diff = [k for k in same if getattr(f, k) != getattr(first, k)]
        if diff:
            raise PatchError(f"patch fragments disagree on {diff}")
    tensors = tuple(t for f in sorted(fragments, key=lambda f: f.fragment[0]) for t in f.tensors)
    if len({t.name for t in tensors}) != len(tensors):
        raise PatchError("patch fragments list the same tensor more than once")
    return dataclasses.replace(first, tensors=tensors, fragment=(0, 1))


def split_fragments(data: bytes) -> list[bytes]:
    """Cut a concatenation of encoded fragments (`b"".join(parts)`) at their framing lengths."""
    parts, offset = [], 0
    while offset < len(data):
        if len(data) - offset < PREFIX.size + DIGEST_BYTES:
            raise PatchError(
                f"patch is truncated: {len(data) - offset} trailing bytes cannot hold a fragment"
            )
        _, _, _, _, header_len, _, body_len, _ = PREFIX.unpack_from(data, offset)
        end = offset + PREFIX.size + header_len + body_len + DIGEST_BYTES
        if end > len(data):
            raise PatchError(
                f"patch is truncated: a fragment needs {end - offset} bytes, {len(data) - offset} left"
            )
        parts.append(bytes(data[offset:end]))
        offset = end
    return parts


def decode_fragments(parts: bytes | list[bytes]) -> DecodedPatch:
    """Decode one patch, or the fragments of one version: a list, or their concatenation.

    Every fragment is validated before anything is returned.
    """
    if isinstance(parts, bytes | bytearray | memoryview):
        parts = split_fragments(bytes(parts)) or [b""]
    return merge_fragments([decode_patch(p) for p in parts])


def inspect_patch(data: bytes) -> dict:
    """Validated summary of a patch: versions, encoding, per-tensor nnz/sparsity, byte counts."""
    parts = split_fragments(data) or [b""]
    compression, _ = read_header(parts[0])
    patch = decode_fragments(parts)
    changed = sum(t.stored.size for t in patch.tensors)
    return {
        "format_version": FORMAT_VERSION,
        "version": patch.version,
        "base_version": patch.base_version,
        "anchor_version": patch.anchor_version,
        "full": patch.full,
        "encoding": patch.encoding,
        "compression": COMPRESSIONS[compression],
        "bytes": len(data),
        "fragments": len(parts),
        "model_tensors": patch.model_tensors,
        "model_numel": patch.model_numel,
        "changed_elements": changed,
        "sparsity": 1.0 - changed / patch.model_numel if patch.model_numel else 0.0,
        "bytes_per_changed_element": len(data) / changed if changed else None,
        "dense_bytes": 2 * patch.model_numel,
        "ratio_vs_dense": 2 * patch.model_numel / len(data),
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nnz": int(t.stored.size),
                "dense": t.dense,
                "sparsity": 1.0 - t.stored.size / max(1, int(np.prod(t.shape))),
            }
            for t in patch.tensors
        ],
    }
