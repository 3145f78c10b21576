"""Byte format of a sparse BF16 weight patch (format version 3; layout in docs/sync.md).

A patch lists, per HF tensor, the flat positions whose 16-bit pattern changed and the new values
in one of `VALUE_ENCODINGS`. Positions are split into magnitude classes of the *base* values
(`positions.py`: small weights flip far more often, and the receiver holds the base exactly), and
each class's changed positions travel as gaps among that class's elements (gap = distance to the
previous changed rank minus one), at a per-run width of one byte or two byte planes (two when
>= 1/8 of the gaps would not fit a byte); the largest value of that width escapes into a stream
of the narrowest unsigned width that fits. A tensor without cuts (one class) is the plain model,
which needs no base. Values travel in the same class-major order as two byte planes (low, high):
uniform statistics per stream are what zstd's entropy stage needs. Each stream (and the JSON
header) is its own zstd frame. A *full* patch (`base_version=None`) carries every element densely
and is the fallback / anchor.

`decode_patch` validates everything that does not need the receiver (length, magic, trailer
xxh3-128 over all bytes, header schema, stream lengths, rank ranges) before anything is returned;
`resolve_positions` turns class ranks into flat indices against the receiver's base values (a base
whose class sizes differ is rejected); applying is in `apply.py`.
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

from sparserl_mcore.sync import positions
from sparserl_mcore.sync.hashing import DIGEST_BYTES, DTYPES

FORMAT_VERSION = 3
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
# "base": magnitude classes of the base values where the encoder estimates a saving (receivers must
# hold each touched tensor whole); "plain": one class, decodable without the base
POSITION_MODELS = ("base", "plain")
DIGEST_SCOPES = ("tensor", "touched")


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
    """encoding: a `VALUE_ENCODINGS` key; zstd_level: 1..22, or None to store the body raw;
    position_model: a `POSITION_MODELS` name ("plain" for receivers holding only part of a tensor,
    e.g. one TP rank of a multi-process engine)."""

    encoding: str = "sub"
    zstd_level: int | None = 1
    position_model: str = "base"

    def __post_init__(self) -> None:
        if self.encoding not in VALUE_ENCODINGS:
            raise ValueError(
                f"encoding={self.encoding!r} is unknown; choose from {', '.join(VALUE_ENCODINGS)}"
            )
        if self.zstd_level is not None and not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level} is out of range; use 1..22, or None for no zstd")
        if self.position_model not in POSITION_MODELS:
            raise ValueError(
                f"position_model={self.position_model!r} is unknown; choose from {', '.join(POSITION_MODELS)}"
            )


# --- in-memory patch ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TensorChange:
    """One tensor's change. indices=None: dense (every element, values are the new bits).

    old_bits is required for sparse changes under a delta encoding (xor, sub). base_bits: the whole
    tensor's flat bits, before or after the change (only unchanged positions are read), which lets
    the `base` position model code positions against the receiver's base; None: plain positions.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    new_bits: np.ndarray
    old_bits: np.ndarray | None
    digest: bytes
    base_bits: np.ndarray | None = None

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
    # "tensor": each digest covers the whole tensor after the patch (and model_digest the model);
    # "touched": each digest covers only the new values at the fragment's positions and
    # model_digest is unused: per-rank fragments, made without any rank holding whole tensors
    digest_scope: str = "tensor"


@dataclass(frozen=True, kw_only=True)
class BaseClasses:
    """Positions still coded against the base: per-class ascending ranks (stored values follow the
    same class-major order) and the class sizes the encoder's base had."""

    cuts: tuple[int, ...]
    sizes: tuple[int, ...]
    ranks: tuple[np.ndarray, ...]


@dataclass(frozen=True, kw_only=True)
class DecodedTensor:
    """indices: ascending flat positions; None for a dense tensor, or (with `classes`) until
    `resolve_positions` has the receiver's base."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    stored: np.ndarray
    digest: bytes
    classes: BaseClasses | None = None

    @property
    def dense(self) -> bool:
        return self.indices is None and self.classes is None


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
    digest_scope: str = "tensor"

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


def _encode_positions(
    change: TensorChange, config: CodecConfig
) -> tuple[dict, list[bytes], list[bytes], np.ndarray | None]:
    """(header fields, gap planes and escape bytes per class run, class-major order of the changes
    or None when that is the flat order)."""
    indices, cuts = change.indices, ()
    base_coded = config.position_model == "base" and VALUE_ENCODINGS[config.encoding].needs_base
    if base_coded and change.base_bits is not None and change.old_bits is not None:
        old = change.old_bits.astype(np.uint16, copy=False)
        base = change.base_bits.reshape(-1).view(np.uint16)
        cuts = positions.choose_cuts(base, old)
    if cuts:
        new = change.new_bits.astype(np.uint16, copy=False)
        ranks, order, sizes = positions.class_ranks(indices, old, new, base, cuts)
    else:
        ranks, order, sizes = [indices], None, [change.numel]
    fields: dict = {"cuts": list(cuts), "class_sizes": sizes, "runs": []}
    planes, escapes = [], []
    for r in ranks:
        gap_planes, gap_width, esc, width, n_escape = _encode_indices(r)
        planes.append(gap_planes)
        escapes.append(esc if n_escape else b"")
        fields["runs"].append([int(r.size), gap_width, width, n_escape])
    return fields, planes, escapes, order


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


# one tensor's share of the body streams: gap planes, escapes (per class run), stored values (uint16 LE)
_TensorStreams = tuple[list[bytes], list[bytes], np.ndarray]


def _encode_tensor(change: TensorChange, config: CodecConfig) -> tuple[dict, _TensorStreams]:
    """Header entry and stream parts of one tensor (runs in the encode thread pool)."""
    entry = {"name": change.name, "dtype": change.dtype, "shape": list(change.shape), "nnz": change.nnz}
    stored = _stored_values(change, config.encoding).astype("<u2", copy=False)
    planes: list[bytes] = []
    escapes: list[bytes] = []
    if change.indices is None:
        entry.update(dense=True, cuts=[], class_sizes=[change.numel], runs=[])
    else:
        fields, planes, escapes, order = _encode_positions(change, config)
        entry.update(dense=False, **fields)
        stored = stored if order is None else stored[order]
    entry["digest"] = change.digest.hex()
    return entry, (planes, escapes, stored)


def _place(body: np.ndarray, offsets: tuple[int, int, int, int], parts: _TensorStreams) -> None:
    """Copy one tensor's parts to their offsets in the four body streams (value bytes de-interleaved)."""
    planes, escapes, values = parts
    gap_at, esc_at, lo_at, hi_at = offsets
    for chunks, at in ((planes, gap_at), (escapes, esc_at)):
        for chunk in chunks:
            body[at : at + len(chunk)] = np.frombuffer(chunk, np.uint8)
            at += len(chunk)
    value_bytes = values.view(np.uint8)
    body[lo_at : lo_at + values.size] = value_bytes[0::2]
    body[hi_at : hi_at + values.size] = value_bytes[1::2]


def _raw_streams(pool: ThreadPoolExecutor, encoded: list[_TensorStreams]) -> list[np.ndarray]:
    """The four raw streams, each concatenated over tensors in order, as views of one buffer.

    Written once by the pool: no per-stream joins or `tobytes` copies.
    """
    sizes = [sum(len(c) for parts in encoded for c in parts[k]) for k in range(2)]
    n_values = sum(parts[2].size for parts in encoded)
    sizes += [n_values, n_values]
    body = np.empty(sum(sizes), np.uint8)
    starts = list(itertools.accumulate(sizes, initial=0))
    at = starts[:4]
    jobs = []
    for parts in encoded:
        jobs.append(pool.submit(_place, body, (at[0], at[1], at[2], at[3]), parts))
        lengths = (sum(map(len, parts[0])), sum(map(len, parts[1])), parts[2].size, parts[2].size)
        at = [a + n for a, n in zip(at, lengths, strict=True)]
    for job in jobs:
        job.result()
    return [body[a:b] for a, b in itertools.pairwise(starts)]


def _compress(level: int, stream: np.ndarray) -> bytes:
    """One zstd frame (a compressor per call: they are not thread-safe; zstd releases the GIL)."""
    return zstandard.ZstdCompressor(level=level).compress(stream) if stream.size else b""


def encode_patch(patch: Patch, config: CodecConfig = CodecConfig()) -> bytes:
    """Serialise `patch`; the result is self-checking (trailing xxh3-128 over all bytes).

    Tensors are encoded, and the four streams compressed, in a thread pool (numpy and zstd release
    the GIL); the bytes do not depend on it.
    """
    with ThreadPoolExecutor(worker_count()) as pool:
        encoded = list(pool.map(lambda change: _encode_tensor(change, config), patch.tensors))
        streams = _raw_streams(pool, [parts for _, parts in encoded])
        if config.zstd_level is None:
            compression, stored_streams = 0, [s.tobytes() for s in streams]
        else:
            # single-threaded zstd per stream (threads=-1 gave no speedup at level 1 on 2 cores).
            # One frame per stream: each gets its own entropy tables (0.2-2 % smaller at >= 98.5 %
            # sparsity), and the four frames compress in parallel.
            compression = 1
            stored_streams = list(pool.map(lambda s: _compress(config.zstd_level, s), streams))
    raw_header_fields = {
        "version": patch.version,
        "base_version": patch.base_version,
        "anchor_version": patch.anchor_version,
        "encoding": config.encoding,
        "model_digest": patch.model_digest.hex(),
        "model_tensors": patch.model_tensors,
        "model_numel": patch.model_numel,
        "fragment": list(patch.fragment),
        **({"digest_scope": patch.digest_scope} if patch.digest_scope != "tensor" else {}),
        "tensors": [entry for entry, _ in encoded],
        "streams": {
            key: [raw.size, len(st)] for key, raw, st in zip(STREAMS, streams, stored_streams, strict=True)
        },
    }
    raw_header = json.dumps(raw_header_fields, separators=(",", ":")).encode()
    if compression:
        header_bytes = zstandard.ZstdCompressor(level=config.zstd_level).compress(raw_header)
    else:
        header_bytes = raw_header
    body = b"".join(stored_streams)
    raw_len = sum(s.size for s in streams)
    prefix = _PREFIX.pack(
        MAGIC, FORMAT_VERSION, compression, 0, len(header_bytes), len(raw_header), len(body), raw_len
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


def _int_list(entry: dict, key: str, where: str) -> list[int]:
    value = _field(entry, key, list, where)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise PatchError(f"patch header: {where}.{key} {value} is not a list of non-negative integers")
    return value


@dataclass(frozen=True)
class _Entry:
    """One tensor's validated header entry. runs: (nnz, gap width, escape width, escapes) per class."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nnz: int
    dense: bool
    cuts: tuple[int, ...]
    sizes: tuple[int, ...]
    runs: tuple[tuple[int, int, int, int], ...]
    digest: bytes


def _check_entry(entry: dict, i: int) -> _Entry:
    where = f"tensors[{i}]"
    name = _field(entry, "name", str, where)
    dtype = _field(entry, "dtype", str, where)
    if dtype not in DTYPES:
        raise PatchError(f"patch header: {where} dtype {dtype!r} unsupported; known: {', '.join(DTYPES)}")
    shape = tuple(_int_list(entry, "shape", where))
    numel = int(np.prod(shape, dtype=np.int64))
    nnz, dense = _field(entry, "nnz", int, where), _field(entry, "dense", bool, where)
    if not 0 <= nnz <= numel or dense and nnz != numel:
        raise PatchError(f"patch header: {where} ({name}) nnz {nnz} does not fit numel {numel}")
    cuts, sizes = tuple(_int_list(entry, "cuts", where)), tuple(_int_list(entry, "class_sizes", where))
    ascending = all(a < b for a, b in zip((0, *cuts), cuts, strict=False))
    if (
        len(cuts) >= positions.MAX_CLASSES
        or not ascending
        or any(c > positions.MAX_CUT for c in cuts)
        or (dense and cuts)
        or len(sizes) != len(cuts) + 1
        or sum(sizes) != numel
    ):
        raise PatchError(
            f"patch header: {where} ({name}) cuts {list(cuts)} / class sizes {list(sizes)} invalid"
        )
    runs = []
    for k, run in enumerate(_field(entry, "runs", list, where)):
        ints = isinstance(run, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in run)
        if not ints or len(run) != 4:
            raise PatchError(f"patch header: {where} ({name}) run {k} {run} is not 4 integers")
        run_nnz, gap_width, width, n_escape = run
        if not 0 <= run_nnz <= sizes[min(k, len(sizes) - 1)] or gap_width not in GAP_WIDTHS:
            raise PatchError(f"patch header: {where} ({name}) run {k} {run} invalid")
        if (width == 0) != (n_escape == 0) or width not in (0, *_WIDTHS) or not 0 <= n_escape <= run_nnz:
            raise PatchError(
                f"patch header: {where} ({name}) escape width {width} / count {n_escape} invalid"
            )
        runs.append((run_nnz, gap_width, width, n_escape))
    if len(runs) != (0 if dense else len(sizes)) or sum(r[0] for r in runs) != (0 if dense else nnz):
        raise PatchError(f"patch header: {where} ({name}) runs do not match its classes / nnz {nnz}")
    digest = _digest(_field(entry, "digest", str, where), where)
    return _Entry(name, dtype, shape, nnz, dense, cuts, sizes, tuple(runs), digest)


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
    """Parse and fully validate a patch. Raises PatchError naming the first problem found.

    Tensors coded against the base keep `classes` (indices None) until `resolve_positions`.
    """
    compression, header, body, raw_len = _split_container(data)
    encoding = _field(header, "encoding", str, "header")
    if encoding not in VALUE_ENCODINGS:
        raise PatchError(f"patch encoding {encoding!r} unknown; known: {', '.join(VALUE_ENCODINGS)}")
    version = _field(header, "version", int, "header")
    base = header.get("base_version")
    if base is not None and not isinstance(base, int) or isinstance(base, bool):
        raise PatchError("patch header: base_version must be an integer or null")
    scope = header.get("digest_scope", "tensor")
    if scope not in DIGEST_SCOPES:
        raise PatchError(f"patch header: digest_scope {scope!r} unknown; known: {', '.join(DIGEST_SCOPES)}")
    if scope == "touched" and base is None and encoding != "overwrite":
        raise PatchError("a full fragment with touched digests must use the overwrite encoding")
    raw_streams = _streams(compression, _field(header, "streams", dict, "header"), body, raw_len)
    gaps_all = np.frombuffer(raw_streams[0], np.uint8)
    escapes_all = raw_streams[1]
    lo, hi = (np.frombuffer(x, np.uint8) for x in raw_streams[2:])
    if lo.size != hi.size:
        raise PatchError("patch value planes differ in length")
    values_all = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    tensors, seen = [], set()
    g = e = v = 0
    for i, raw_entry in enumerate(_field(header, "tensors", list, "header")):
        entry = _check_entry(raw_entry, i)
        if entry.name in seen:
            raise PatchError(f"patch lists tensor {entry.name!r} twice")
        seen.add(entry.name)
        if base is None and not entry.dense and scope == "tensor":
            raise PatchError(f"full patch (no base version) has a sparse tensor {entry.name!r}")
        ranks = []
        for k, (nnz, gap_width, width, n_escape) in enumerate(entry.runs):
            # lower classes: ranks among the class's elements; the bulk (last run): flat indices
            span = entry.sizes[k] if k < len(entry.cuts) else int(np.prod(entry.shape, dtype=np.int64))
            if g + nnz * gap_width > gaps_all.size or e + n_escape * width > len(escapes_all):
                raise PatchError(f"tensor {entry.name!r}: index streams end early")
            ranks.append(
                _decode_indices(
                    gaps_all[g : g + nnz * gap_width],
                    gap_width,
                    bytes(escapes_all[e : e + n_escape * width]),
                    width,
                    span,
                    entry.name,
                )
            )
            g, e = g + nnz * gap_width, e + n_escape * width
        if v + entry.nnz > values_all.size:
            raise PatchError(f"tensor {entry.name!r}: value stream ends early")
        classes = None
        if entry.cuts:
            classes = BaseClasses(cuts=entry.cuts, sizes=entry.sizes, ranks=tuple(ranks))
        tensors.append(
            DecodedTensor(
                name=entry.name,
                dtype=entry.dtype,
                shape=entry.shape,
                indices=ranks[0] if ranks and not entry.cuts else None,
                stored=values_all[v : v + entry.nnz],
                digest=entry.digest,
                classes=classes,
            )
        )
        v += entry.nnz
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
        digest_scope=scope,
    )


def _streams(compression: int, table: dict, body: bytes, raw_len: int) -> list[bytes]:
    """The raw bytes of each body stream: `table[key] = [raw length, stored length]`, frames in order."""
    sizes = []
    for key in STREAMS:
        pair = table.get(key)
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
        ):
            raise PatchError(f"patch header: streams.{key} is not [raw length, stored length]")
        sizes.append(pair)
    if sum(r for r, _ in sizes) != raw_len or sum(s for _, s in sizes) != len(body):
        raise PatchError(
            f"patch streams {sizes} do not add up to the body ({len(body)} stored, {raw_len} raw)"
        )
    out, offset = [], 0
    for key, (raw, stored) in zip(STREAMS, sizes, strict=True):
        frame = bytes(body[offset : offset + stored])
        out.append(frame if raw == 0 and stored == 0 else _unpack(compression, frame, raw, f"stream {key}"))
        offset += stored
    return out


def resolve_positions(patch: DecodedPatch, base_bits: Callable[[str], np.ndarray]) -> DecodedPatch:
    """Flat indices for every tensor coded against the base; `base_bits(name)`: the receiver's uint16
    bits of that tensor (its base version, already checked by name/shape/dtype). A base
    whose class sizes differ from the encoder's raises PatchError; one that differs only inside a
    class decodes to wrong positions, which the digests after the writes catch."""
    if not any(t.classes is not None for t in patch.tensors):
        return patch
    tensors = []
    for t in patch.tensors:
        if t.classes is None:
            tensors.append(t)
            continue
        base = np.asarray(base_bits(t.name), dtype=np.uint16).reshape(-1)
        if base.size != sum(t.classes.sizes):
            raise PatchError(
                f"tensor {t.name!r}: the base holds {base.size} elements, the patch {sum(t.classes.sizes)}"
            )
        flat = positions.class_positions(base, t.classes.cuts, list(t.classes.sizes), list(t.classes.ranks))
        if flat is None:
            raise PatchError(
                f"tensor {t.name!r}: the receiver's base values do not match the patch's position classes "
                "(wrong or corrupt base)"
            )
        order = np.argsort(flat, kind="stable")  # class-major runs of ascending indices: a merge
        tensors.append(dataclasses.replace(t, indices=flat[order], stored=t.stored[order], classes=None))
    return dataclasses.replace(patch, tensors=tuple(tensors))


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
                "dense": t.dense,
                "sparsity": 1.0 - t.stored.size / max(1, int(np.prod(t.shape))),
            }
            for t in patch.tensors
        ],
    }
