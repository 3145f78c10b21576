"""Byte format of a sparse BF16 weight patch (format version 2; layout in docs/sync.md).

A patch lists, per HF tensor, the flat positions whose 16-bit pattern changed and the new values
in one of `VALUE_ENCODINGS`. Positions travel as gaps (gap = distance to the previous changed
position minus one) of a per-tensor width, one byte or two byte planes (two when >= 1/8 of the
tensor's gaps would not fit a byte, as at >= 99 % sparsity); the largest value of that width
escapes into a per-tensor stream of the narrowest unsigned width that fits. Values travel as two
byte planes (low, high): this keeps each stream's statistics uniform so zstd level 1 gets near
~1.2 bytes per changed element at 99 % sparsity. The JSON header is zstd-compressed along with
the body (it was ~10 % of a 0.1 MB patch). A *full* patch
(`base_version=None`) carries every element densely and is the fallback / anchor.

`decode_patch` validates everything (length, magic, trailer xxh3-128 over all bytes, header
schema, stream lengths, index ranges) before anything is returned; applying is in `apply.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from sparserl_mcore.sync.hashing import DIGEST_BYTES, DTYPES

FORMAT_VERSION = 2
MAGIC = b"SRLPATCH"
# magic, format version, compression id, reserved, stored header bytes, raw header bytes,
# stored body bytes, raw body bytes
_PREFIX = struct.Struct("<8sHBBIIQQ")
COMPRESSIONS = {0: "none", 1: "zstd"}
STREAMS = ("gaps", "escapes", "values_lo", "values_hi")
_WIDTHS = (1, 2, 4, 8)
GAP_WIDTHS = (1, 2)
# two-byte gaps once this share of one-byte gaps would escape. Quick bench shape at 99.5 % sparsity:
# shares 1/32..1/4 all within 0.1 % of two-byte gaps everywhere; one-byte gaps everywhere +2.3 %.
_WIDE_GAP_SHARE = 1 / 8


class PatchError(ValueError):
    """A patch is malformed, corrupt, or does not fit the receiver; nothing was applied."""


# --- value encodings: (old bits, new bits) -> stored uint16, and back (exact, modulo 2**16) -------


def _zigzag(delta: np.ndarray) -> np.ndarray:
    """Zigzag of int16 deltas in 16-bit arithmetic (no int32 temporaries; the shift wraps mod 2**16)."""
    d = delta.view(np.int16)
    return ((d << 1) ^ (d >> 15)).view(np.uint16)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    z32 = z.astype(np.int32)
    return ((z32 >> 1) ^ -(z32 & 1)).astype(np.uint16)


@dataclass(frozen=True)
class ValueEncoding:
    """How changed values are stored. `needs_base`: applying requires the exact base values."""

    encode: Callable[[np.ndarray, np.ndarray], np.ndarray]
    apply: Callable[[np.ndarray, np.ndarray], np.ndarray]
    needs_base: bool


VALUE_ENCODINGS: dict[str, ValueEncoding] = {
    # new bit patterns: idempotent, no float math
    "overwrite": ValueEncoding(lambda old, new: new, lambda old, stored: stored, needs_base=False),
    # old XOR new: applied exactly once against the named base version
    "xor": ValueEncoding(lambda old, new: old ^ new, lambda old, stored: old ^ stored, needs_base=True),
    # zigzag of (new - old) mod 2**16 on the raw bit patterns: a one-ulp step is 1 or 2
    "sub": ValueEncoding(
        lambda old, new: _zigzag(new - old),  # uint16 subtraction wraps mod 2**16
        lambda old, stored: (old.astype(np.int32) + _unzigzag(stored).astype(np.int32)).astype(np.uint16),
        needs_base=True,
    ),
}


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """encoding: a `VALUE_ENCODINGS` key; zstd_level: 1..22, or None to store the body raw."""

    encoding: str = "sub"
    zstd_level: int | None = 1

    def __post_init__(self) -> None:
        if self.encoding not in VALUE_ENCODINGS:
            raise ValueError(
                f"encoding={self.encoding!r} is unknown; choose from {', '.join(VALUE_ENCODINGS)}"
            )
        if self.zstd_level is not None and not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level} is out of range; use 1..22, or None for no zstd")


# --- in-memory patch ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TensorChange:
    """One tensor's change. indices=None: dense (every element, values are the new bits).

    old_bits is required for sparse changes under a delta encoding (xor, sub).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    new_bits: np.ndarray
    old_bits: np.ndarray | None
    digest: bytes

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nnz(self) -> int:
        return int(self.new_bits.size)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """A set of tensor changes taking `base_version` to `version` (base None: a full patch)."""

    version: int
    base_version: int | None
    anchor_version: int
    model_digest: bytes
    model_tensors: int
    model_numel: int
    tensors: tuple[TensorChange, ...]
    # (index, count): a version may travel as several fragments (one per PP stage), applied together
    fragment: tuple[int, int] = (0, 1)


@dataclass(frozen=True, kw_only=True)
class DecodedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    stored: np.ndarray
    digest: bytes


@dataclass(frozen=True, kw_only=True)
class DecodedPatch:
    version: int
    base_version: int | None
    anchor_version: int
    encoding: str
    model_digest: bytes
    model_tensors: int
    model_numel: int
    tensors: tuple[DecodedTensor, ...]
    fragment: tuple[int, int] = (0, 1)

    @property
    def full(self) -> bool:
        return self.base_version is None


# --- encode ---------------------------------------------------------------------------------------


def _escape(gap_width: int) -> int:
    return (1 << (8 * gap_width)) - 1


def _encode_indices(indices: np.ndarray) -> tuple[bytes, int, bytes, int, int]:
    """(gap planes, gap width, escape bytes, escape width, escape count) of sorted flat indices."""
    gaps = np.empty(indices.size, np.int64)
    gaps[:1] = indices[:1]
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    gaps[1:] -= 1
    gap_width = 2 if np.count_nonzero(gaps >= _escape(1)) >= _WIDE_GAP_SHARE * gaps.size else 1
    escape = _escape(gap_width)
    big = gaps >= escape
    escapes = gaps[big] - escape
    width = 0
    if escapes.size:
        top = int(escapes.max())
        width = next(w for w in _WIDTHS if top < 1 << (8 * w))
    small = np.minimum(gaps, escape).astype("<u2" if gap_width == 2 else np.uint8)
    planes = (
        small.tobytes()
        if gap_width == 1
        else small.view(np.uint8)[0::2].tobytes() + small.view(np.uint8)[1::2].tobytes()
    )
    return planes, gap_width, escapes.astype(f"<u{width or 1}").tobytes(), width, int(escapes.size)


def _stored_values(change: TensorChange, encoding: str) -> np.ndarray:
    if change.indices is None or not VALUE_ENCODINGS[encoding].needs_base:
        return change.new_bits
    if change.old_bits is None:
        raise ValueError(f"tensor {change.name!r}: encoding {encoding!r} needs old_bits; use 'overwrite'")
    as16 = [b.astype(np.uint16, copy=False) for b in (change.old_bits, change.new_bits)]
    return VALUE_ENCODINGS[encoding].encode(*as16)


def worker_count() -> int:
    """Threads for the per-tensor work of an encode or diff: torch's intra-op count (OMP_NUM_THREADS)."""
    return max(1, torch.get_num_threads())


# one tensor's share of the body streams: gap planes, escapes, stored values (uint16, little-endian)
_TensorStreams = tuple[bytes, bytes, np.ndarray]


def _encode_tensor(change: TensorChange, encoding: str) -> tuple[dict, _TensorStreams]:
    """Header entry and stream parts of one tensor (runs in the encode thread pool)."""
    entry = {"name": change.name, "dtype": change.dtype, "shape": list(change.shape), "nnz": change.nnz}
    if change.indices is None:
        planes, esc = b"", b""
        entry.update(dense=True, gap_width=0, escape_width=0, n_escape=0)
    else:
        planes, gap_width, esc, width, n_escape = _encode_indices(change.indices)
        esc = esc if n_escape else b""
        entry.update(dense=False, gap_width=gap_width, escape_width=width, n_escape=n_escape)
    entry["digest"] = change.digest.hex()
    return entry, (planes, esc, _stored_values(change, encoding).astype("<u2", copy=False))


def _place(body: np.ndarray, offsets: tuple[int, int, int, int], parts: _TensorStreams) -> None:
    """Copy one tensor's parts to their offsets in the four body streams (value bytes de-interleaved)."""
    planes, esc, values = parts
    gap_at, esc_at, lo_at, hi_at = offsets
    body[gap_at : gap_at + len(planes)] = np.frombuffer(planes, np.uint8)
    body[esc_at : esc_at + len(esc)] = np.frombuffer(esc, np.uint8)
    value_bytes = values.view(np.uint8)
    body[lo_at : lo_at + values.size] = value_bytes[0::2]
    body[hi_at : hi_at + values.size] = value_bytes[1::2]


def _body(pool: ThreadPoolExecutor, encoded: list[_TensorStreams]) -> tuple[np.ndarray, list[int]]:
    """The raw body (the four streams, each concatenated over tensors in order) and stream sizes.

    Written once into one buffer by the pool: no per-stream joins or `tobytes` copies.
    """
    sizes = [sum(len(parts[k]) for parts in encoded) for k in range(2)]
    n_values = sum(parts[2].size for parts in encoded)
    sizes += [n_values, n_values]
    body = np.empty(sum(sizes), np.uint8)
    at = list(itertools.accumulate(sizes[:3], initial=0))  # where each stream starts
    jobs = []
    for parts in encoded:
        jobs.append(pool.submit(_place, body, (at[0], at[1], at[2], at[3]), parts))
        at = [at[0] + len(parts[0]), at[1] + len(parts[1]), at[2] + parts[2].size, at[3] + parts[2].size]
    for job in jobs:
        job.result()
    return body, sizes


def encode_patch(patch: Patch, config: CodecConfig = CodecConfig()) -> bytes:
    """Serialise `patch`; the result is self-checking (trailing xxh3-128 over all bytes).

    Tensors are encoded in a thread pool (numpy releases the GIL); the bytes do not depend on it.
    """
    with ThreadPoolExecutor(worker_count()) as pool:
        encoded = list(pool.map(lambda change: _encode_tensor(change, config.encoding), patch.tensors))
        raw, sizes = _body(pool, [parts for _, parts in encoded])
    header = {
        "version": patch.version,
        "base_version": patch.base_version,
        "anchor_version": patch.anchor_version,
        "encoding": config.encoding,
        "model_digest": patch.model_digest.hex(),
        "model_tensors": patch.model_tensors,
        "model_numel": patch.model_numel,
        "fragment": list(patch.fragment),
        "tensors": [entry for entry, _ in encoded],
        "streams": dict(zip(STREAMS, sizes, strict=True)),
    }
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    if config.zstd_level is None:
        compression, header_bytes, body = 0, raw_header, raw.tobytes()
    else:
        # single-threaded zstd: threads=-1 gave no speedup at level 1 on 2 cores (0.09 vs 0.10 s for 41 MB)
        zstd = zstandard.ZstdCompressor(level=config.zstd_level)
        compression, header_bytes, body = 1, zstd.compress(raw_header), zstd.compress(raw)
    prefix = _PREFIX.pack(
        MAGIC, FORMAT_VERSION, compression, 0, len(header_bytes), len(raw_header), len(body), raw.size
    )
    h = xxhash.xxh3_128()
    for part in (prefix, header_bytes, body):
        h.update(part)
    return b"".join((prefix, header_bytes, body, h.digest()))


# --- decode ---------------------------------------------------------------------------------------


def _split_container(data: bytes) -> tuple[int, dict, bytes, int]:
    """Check framing and the trailing digest; return (compression, header, stored body, raw size)."""
    if len(data) < _PREFIX.size + DIGEST_BYTES:
        raise PatchError(
            f"patch is truncated: {len(data)} bytes, the fixed framing alone is {_PREFIX.size + DIGEST_BYTES}"
        )
    magic, fmt, compression, reserved, header_len, raw_header_len, body_len, raw_len = _PREFIX.unpack_from(
        data
    )
    if magic != MAGIC:
        raise PatchError(f"not a sparserl patch: magic {magic!r}, expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise PatchError(f"patch format version {fmt} is not supported (this reader: {FORMAT_VERSION})")
    expected = _PREFIX.size + header_len + body_len + DIGEST_BYTES
    if len(data) != expected:
        raise PatchError(
            f"patch length {len(data)} != {expected} declared by its framing (truncated or padded)"
        )
    if xxhash.xxh3_128_digest(memoryview(data)[:-DIGEST_BYTES]) != data[-DIGEST_BYTES:]:
        raise PatchError("patch checksum mismatch: the bytes were corrupted or reordered")
    if compression not in COMPRESSIONS or reserved != 0:
        raise PatchError(f"patch compression id {compression} / reserved {reserved} is invalid")
    stored_header = bytes(data[_PREFIX.size : _PREFIX.size + header_len])
    try:
        header = json.loads(_unpack(compression, stored_header, raw_header_len, "header"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PatchError(f"patch header is not valid JSON: {exc}") from exc
    body = data[_PREFIX.size + header_len : -DIGEST_BYTES]
    return compression, header, body, raw_len


def _field(obj: dict, key: str, kind: type | tuple[type, ...], where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise PatchError(f"patch header: {where}.{key} is missing or not {kind}")
    return value


def _digest(text: str, where: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError as exc:
        raise PatchError(f"patch header: {where} is not hex") from exc
    if len(value) != DIGEST_BYTES:
        raise PatchError(f"patch header: {where} must be {DIGEST_BYTES} bytes")
    return value


def _check_entry(entry: dict, i: int) -> tuple[str, str, tuple[int, ...], int, bool, int, int, int, bytes]:
    where = f"tensors[{i}]"
    name = _field(entry, "name", str, where)
    dtype = _field(entry, "dtype", str, where)
    if dtype not in DTYPES:
        raise PatchError(f"patch header: {where} dtype {dtype!r} unsupported; known: {', '.join(DTYPES)}")
    shape = tuple(_field(entry, "shape", list, where))
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PatchError(f"patch header: {where}.shape {list(shape)} is not a list of sizes")
    numel = int(np.prod(shape, dtype=np.int64))
    nnz, dense = _field(entry, "nnz", int, where), _field(entry, "dense", bool, where)
    width, n_escape = _field(entry, "escape_width", int, where), _field(entry, "n_escape", int, where)
    gap_width = _field(entry, "gap_width", int, where)
    if gap_width not in ((0,) if dense else GAP_WIDTHS):
        raise PatchError(f"patch header: {where} ({name}) gap width {gap_width} invalid (dense: {dense})")
    if not 0 <= nnz <= numel or dense and nnz != numel:
        raise PatchError(f"patch header: {where} ({name}) nnz {nnz} does not fit numel {numel}")
    if (width == 0) != (n_escape == 0) or width not in (0, *_WIDTHS) or not 0 <= n_escape <= nnz:
        raise PatchError(f"patch header: {where} ({name}) escape width {width} / count {n_escape} invalid")
    if dense and width:
        raise PatchError(f"patch header: {where} ({name}) is dense but has index escapes")
    return (
        name,
        dtype,
        shape,
        nnz,
        dense,
        gap_width,
        width,
        n_escape,
        _digest(_field(entry, "digest", str, where), where),
    )


def _decode_indices(
    planes: np.ndarray, gap_width: int, escapes: bytes, width: int, numel: int, name: str
) -> np.ndarray:
    nnz = planes.size // gap_width
    steps = planes[:nnz].astype(np.int64)
    if gap_width == 2:
        steps |= planes[nnz:].astype(np.int64) << 8
    escape_at = np.flatnonzero(steps == _escape(gap_width))
    extra = np.frombuffer(escapes, dtype=f"<u{width}") if width else np.zeros(0, np.uint8)
    if escape_at.size != extra.size:
        raise PatchError(f"tensor {name!r}: {escape_at.size} index escapes but {extra.size} escape values")
    if extra.size and int(extra.max()) >= numel:
        raise PatchError(f"tensor {name!r}: index gap out of range for {numel} elements")
    steps[escape_at] += extra.astype(np.int64)
    if steps.size and float(steps.astype(np.float64).sum()) + steps.size > numel + 0.5:
        raise PatchError(f"tensor {name!r}: index out of range for {numel} elements")
    return np.cumsum(steps + 1) - 1


def _unpack(compression: int, stored: bytes, raw_len: int, what: str) -> bytes:
    """The raw bytes of the header or the body; their length must be the one the framing declares."""
    if compression == 0:
        if len(stored) != raw_len:
            raise PatchError(f"patch {what} is {len(stored)} bytes, framing says {raw_len}")
        return stored
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise PatchError(f"patch {what} does not decompress: {exc}") from exc
    if len(raw) != raw_len:
        raise PatchError(f"patch {what} decompressed to {len(raw)} bytes, framing says {raw_len}")
    return raw


def read_header(data: bytes) -> tuple[int, dict]:
    """Framing + checksum checked header (no body decoding): (compression id, header dict)."""
    compression, header, _, _ = _split_container(data)
    return compression, header


def decode_patch(data: bytes) -> DecodedPatch:
    """Parse and fully validate a patch. Raises PatchError naming the first problem found."""
    compression, header, body, raw_len = _split_container(data)
    encoding = _field(header, "encoding", str, "header")
    if encoding not in VALUE_ENCODINGS:
        raise PatchError(f"patch encoding {encoding!r} unknown; known: {', '.join(VALUE_ENCODINGS)}")
    version = _field(header, "version", int, "header")
    base = header.get("base_version")
    if base is not None and not isinstance(base, int) or isinstance(base, bool):
        raise PatchError("patch header: base_version must be an integer or null")
    streams = _field(header, "streams", dict, "header")
    sizes = [_field(streams, key, int, "streams") for key in STREAMS]
    if sum(sizes) != raw_len or min(sizes) < 0:
        raise PatchError(f"patch streams {sizes} do not add up to the body size {raw_len}")
    raw = memoryview(_unpack(compression, body, raw_len, "body"))
    offsets = np.cumsum([0, *sizes])
    gaps_all = np.frombuffer(raw[offsets[0] : offsets[1]], np.uint8)
    escapes_all = raw[offsets[1] : offsets[2]]
    lo = np.frombuffer(raw[offsets[2] : offsets[3]], np.uint8)
    hi = np.frombuffer(raw[offsets[3] : offsets[4]], np.uint8)
    if lo.size != hi.size:
        raise PatchError("patch value planes differ in length")
    values_all = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    tensors, seen = [], set()
    g = e = v = 0
    for i, entry in enumerate(_field(header, "tensors", list, "header")):
        name, dtype, shape, nnz, dense, gap_width, width, n_escape, digest = _check_entry(entry, i)
        if name in seen:
            raise PatchError(f"patch lists tensor {name!r} twice")
        seen.add(name)
        if base is None and not dense:
            raise PatchError(f"full patch (no base version) has a sparse tensor {name!r}")
        indices = None
        if not dense:
            if g + nnz * gap_width > gaps_all.size or e + n_escape * width > len(escapes_all):
                raise PatchError(f"tensor {name!r}: index streams end early")
            indices = _decode_indices(
                gaps_all[g : g + nnz * gap_width],
                gap_width,
                bytes(escapes_all[e : e + n_escape * width]),
                width,
                int(np.prod(shape)),
                name,
            )
            g, e = g + nnz * gap_width, e + n_escape * width
        if v + nnz > values_all.size:
            raise PatchError(f"tensor {name!r}: value stream ends early")
        tensors.append(
            DecodedTensor(
                name=name,
                dtype=dtype,
                shape=shape,
                indices=indices,
                stored=values_all[v : v + nnz],
                digest=digest,
            )
        )
        v += nnz
    if (g, e, v) != (gaps_all.size, len(escapes_all), values_all.size):
        raise PatchError("patch streams hold bytes that no tensor claims")
    return DecodedPatch(
        version=version,
        base_version=base,
        anchor_version=_field(header, "anchor_version", int, "header"),
        encoding=encoding,
        model_digest=_digest(_field(header, "model_digest", str, "header"), "model_digest"),
        model_tensors=_field(header, "model_tensors", int, "header"),
        model_numel=_field(header, "model_numel", int, "header"),
        tensors=tuple(tensors),
        fragment=_fragment(header),
    )


def _fragment(header: dict) -> tuple[int, int]:
    fragment = _field(header, "fragment", list, "header")
    ok = len(fragment) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in fragment)
    if not ok or not 0 <= fragment[0] < fragment[1]:
        raise PatchError(f"patch header: fragment {fragment} is not [index, count] with index < count")
    return fragment[0], fragment[1]


def merge_fragments(fragments: list[DecodedPatch]) -> DecodedPatch:
    """Join the fragments of one version into one patch; every fragment exactly once, names disjoint."""
    if not fragments:
        raise PatchError("no patch fragments given")
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
        if len(data) - offset < _PREFIX.size + DIGEST_BYTES:
            raise PatchError(
                f"patch is truncated: {len(data) - offset} trailing bytes cannot hold a fragment"
            )
        _, _, _, _, header_len, _, body_len, _ = _PREFIX.unpack_from(data, offset)
        end = offset + _PREFIX.size + header_len + body_len + DIGEST_BYTES
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
                "dense": t.indices is None,
                "sparsity": 1.0 - t.stored.size / max(1, int(np.prod(t.shape))),
            }
            for t in patch.tensors
        ],
    }
