"""Decode and validate patches in the byte format of `patch_format.py`.

`decode_patch` validates everything that does not need the receiver (length, magic, trailer
xxh3-128 over all bytes, header schema, stream lengths, rank ranges) before anything is returned;
`resolve_positions` turns class ranks into flat indices against the receiver's base values (a base
whose class sizes differ is rejected); applying is in `apply.py`; fragments in `fragments.py`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from sparserl_mcore.sync import positions
from sparserl_mcore.sync.hashing import DIGEST_BYTES, DTYPES
from sparserl_mcore.sync.patch_format import (
    COMPRESSIONS,
    DIGEST_SCOPES,
    FORMAT_VERSION,
    GAP_WIDTHS,
    MAGIC,
    PREFIX,
    STREAMS,
    VALUE_ENCODINGS,
    WIDTHS,
    BaseClasses,
    DecodedPatch,
    DecodedTensor,
    PatchError,
    gap_escape,
)


def _split_container(data: bytes) -> tuple[int, dict, bytes, int]:
    """Check framing and the trailing digest; return (compression, header, stored body, raw size)."""
    if len(data) < PREFIX.size + DIGEST_BYTES:
        raise PatchError(
            f"patch is truncated: {len(data)} bytes, the fixed framing alone is {PREFIX.size + DIGEST_BYTES}"
        )
    magic, fmt, compression, reserved, header_len, raw_header_len, body_len, raw_len = PREFIX.unpack_from(
        data
    )
    if magic != MAGIC:
        raise PatchError(f"not a sparserl patch: magic {magic!r}, expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise PatchError(f"patch format version {fmt} is not supported (this reader: {FORMAT_VERSION})")
    expected = PREFIX.size + header_len + body_len + DIGEST_BYTES
    if len(data) != expected:
        raise PatchError(
            f"patch length {len(data)} != {expected} declared by its framing (truncated or padded)"
        )
    if xxhash.xxh3_128_digest(memoryview(data)[:-DIGEST_BYTES]) != data[-DIGEST_BYTES:]:
        raise PatchError("patch checksum mismatch: the bytes were corrupted or reordered")
    if compression not in COMPRESSIONS or reserved != 0:
        raise PatchError(f"patch compression id {compression} / reserved {reserved} is invalid")
    stored_header = bytes(data[PREFIX.size : PREFIX.size + header_len])
    try:
        header = json.loads(_unpack(compression, stored_header, raw_header_len, "header"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PatchError(f"patch header is not valid JSON: {exc}") from exc
    body = data[PREFIX.size + header_len : -DIGEST_BYTES]
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
        if (width == 0) != (n_escape == 0) or width not in (0, *WIDTHS) or not 0 <= n_escape <= run_nnz:
            raise PatchError(
                f"patch header: {where} ({name}) escape width {width} / count {n_escape} invalid"
            )
        runs.append((run_nnz, gap_width, width, n_escape))
    if len(runs) != (0 if dense else len(sizes)) or sum(r[0] for r in runs) != (0 if dense else nnz):
        raise PatchError(f"patch header: {where} ({name}) runs do not match its classes / nnz {nnz}")
    digest = _digest(_field(entry, "digest", str, where), where)
    return _Entry(name, dtype, shape, nnz, dense, cuts, sizes, tuple(runs), digest)


def decode_gaps(
    planes: np.ndarray, gap_width: int, escapes: bytes, width: int, numel: int, name: str
) -> np.ndarray:
    """Sorted indices < `numel` from `encode_gaps`'s streams; PatchError naming `name` if malformed."""
    nnz = planes.size // gap_width
    steps = planes[:nnz].astype(np.int64)
    if gap_width == 2:
        steps |= planes[nnz:].astype(np.int64) << 8
    escape_at = np.flatnonzero(steps == gap_escape(gap_width))
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
                decode_gaps(
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
