"""The bytes of one rank's sparse pseudo-gradient (PULSELoCo's wire), coded against the anchor.

Every island holds the same FP32 anchor, so the receiver knows the BF16 bits of every anchor
weight before a byte arrives. The gate fires with a probability set by the anchor's exponent
(small weights have finer BF16 cells), which is exactly the situation of `sync.positions`: the
positions are coded per magnitude class of the base (here bf16(anchor)), as ranks among the
class's elements, gap-coded by `sync.encode.encode_gaps` (one byte per gap below 255 and
escapes, or two-byte gaps where they pay). The FP32 values are split into their four byte planes
(sign and exponent bytes compress well) and each stream is one zstd frame.

The anchor bits are checked per range (`spans`: the outer step passes the lengths of its owned
parameter ranges): the payload carries an xxh3-64 of each range of the bits it was coded against,
and a receiver whose bits differ refuses it with `BaseMismatch`, naming the first range that
differs (so islands out of step are reported by tensor, and a payload damaged in transit, which
fails the checksum, is told apart from them).

Layout (little endian): `HEAD` (magic, version, compressed?, cut count, numel, nnz, range count),
the range digests (uint64 each), the cuts (uint16 each), the class sizes (uint64 each, one more
than cuts), per class run `RUN` (nnz, gap width, escape width, escapes), `STREAMS` (raw and stored
lengths of the position and value streams), the two streams, and an xxh3-64 of everything before
it. The authors send 12 bytes per entry (int64 index + FP32 value); `bytes_per_entry` in the outer
step's metrics is this format's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash
import zstandard

from sparserl_mcore.sync import positions
from sparserl_mcore.sync.decode import decode_gaps
from sparserl_mcore.sync.encode import encode_gaps

MAGIC, VERSION = b"PLC1", 2
HEAD = struct.Struct("<4sBBHQQQ")
RUN = struct.Struct("<QBBQ")
STREAMS = struct.Struct("<QQQQ")
TRAILER = 8


class PayloadError(ValueError):
    """A payload is malformed, corrupt, or coded against another anchor."""


class BaseMismatch(PayloadError):
    """The payload is intact but was coded against other anchor bits; `span` is the index of the
    first range (of the `spans` both sides passed) whose bits differ."""

    def __init__(self, span: int) -> None:
        super().__init__(f"payload was coded against other anchor bits in range {span} (islands out of step)")
        self.span = span


def _digests(base_bits: np.ndarray, spans: Sequence[int] | None) -> np.ndarray:
    """xxh3-64 of each consecutive range of `base_bits` (one range when `spans` is None)."""
    spans = [base_bits.size] if spans is None else spans
    if sum(spans) != base_bits.size:
        raise ValueError(f"spans add up to {sum(spans)} elements, the base has {base_bits.size}")
    ends = np.cumsum(spans)
    return np.array(
        [xxhash.xxh3_64_intdigest(base_bits[e - n : e].tobytes()) for n, e in zip(spans, ends, strict=True)],
        dtype="<u8",
    )


def _pack(stream: bytes, level: int | None) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(stream) if level is not None and stream else stream


def encode(
    indices: np.ndarray,
    values: np.ndarray,
    base_bits: np.ndarray,
    *,
    spans: Sequence[int] | None = None,
    level: int | None = 1,
) -> bytes:
    """`indices` (ascending int64) and their FP32 `values`, against `base_bits` (uint16, bf16 of
    the anchor, one per element of the shard), checked per range of `spans` (lengths; None: one)."""
    numel, digests = base_bits.size, _digests(base_bits, spans)
    cuts: tuple[int, ...] = ()
    if indices.size:
        old = base_bits[indices]
        cuts = positions.choose_cuts(base_bits, old)
    if cuts:
        ranks, order, sizes = positions.class_ranks(indices, old, old, base_bits, cuts)
        values = values[order]
    else:
        ranks, sizes = [indices], [numel]
    runs, gaps, escapes = [], [], []
    for r in ranks:
        planes, gap_width, esc, width, n_escape = encode_gaps(r)
        runs.append(RUN.pack(r.size, gap_width, width, n_escape))
        gaps.append(planes)
        escapes.append(esc if n_escape else b"")
    position_stream = b"".join(gaps + escapes)
    value_stream = np.ascontiguousarray(values.astype("<f4").view(np.uint8).reshape(-1, 4).T).tobytes()
    stored = [_pack(position_stream, level), _pack(value_stream, level)]
    body = b"".join(
        (
            HEAD.pack(
                MAGIC,
                VERSION,
                int(level is not None),
                len(cuts),
                numel,
                int(indices.size),
                digests.size,
            ),
            digests.tobytes(),
            np.asarray(cuts, "<u2").tobytes(),
            np.asarray(sizes, "<u8").tobytes() if cuts else b"",
            *runs,
            STREAMS.pack(len(position_stream), len(stored[0]), len(value_stream), len(stored[1])),
            *stored,
        )
    )
    return body + xxhash.xxh3_64_digest(body)


def _unpack(data: bytes, raw_len: int, compressed: bool) -> bytes:
    if not compressed or not data:
        out = data
    else:
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise PayloadError(f"payload stream does not decompress: {exc}") from None
    if len(out) != raw_len:
        raise PayloadError(f"payload stream has {len(out)} bytes, its header says {raw_len}")
    return out


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise PayloadError("payload ends early")
        self.at += n
        return self.data[self.at - n : self.at]


def decode(
    blob: bytes, base_bits: np.ndarray, *, spans: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(int64 indices, FP32 values) in the sender's (class-major) order; PayloadError if corrupt,
    BaseMismatch if coded against other anchor bits (`spans` as the sender's `encode`)."""
    if len(blob) < HEAD.size + TRAILER or xxhash.xxh3_64_digest(blob[:-TRAILER]) != blob[-TRAILER:]:
        raise PayloadError("payload checksum mismatch (truncated or corrupt)")
    read = _Reader(blob[:-TRAILER])
    magic, version, compressed, n_cuts, numel, nnz, n_spans = HEAD.unpack(read.take(HEAD.size))
    if magic != MAGIC or version != VERSION:
        raise PayloadError(f"not a PULSELoCo payload (magic {magic!r}, version {version})")
    if numel != base_bits.size:
        raise PayloadError(f"payload codes {numel} elements, this shard has {base_bits.size}")
    theirs, mine = np.frombuffer(read.take(8 * n_spans), "<u8"), _digests(base_bits, spans)
    if theirs.size != mine.size:
        raise PayloadError(f"payload checks {theirs.size} anchor ranges, this shard has {mine.size}")
    differ = np.flatnonzero(theirs != mine)
    if differ.size:
        raise BaseMismatch(int(differ[0]))
    cuts = tuple(int(c) for c in np.frombuffer(read.take(2 * n_cuts), "<u2"))
    sizes = [int(s) for s in np.frombuffer(read.take(8 * (n_cuts + 1)), "<u8")] if cuts else [numel]
    runs = [RUN.unpack(read.take(RUN.size)) for _ in range(len(cuts) + 1)]
    pos_raw, pos_len, val_raw, val_len = STREAMS.unpack(read.take(STREAMS.size))
    position_stream = np.frombuffer(_unpack(read.take(pos_len), pos_raw, bool(compressed)), np.uint8)
    value_stream = _unpack(read.take(val_len), val_raw, bool(compressed))
    if sum(r[0] for r in runs) != nnz or val_raw != 4 * nnz:
        raise PayloadError(f"payload runs / values do not add up to its {nnz} entries")
    ranks, g = [], 0
    e = sum(r[0] * r[1] for r in runs)
    for k, (run_nnz, gap_width, width, n_escape) in enumerate(runs):
        span = sizes[k] if k < len(cuts) else numel
        if g + run_nnz * gap_width > e or e + n_escape * width > position_stream.size:
            raise PayloadError("payload position stream ends early")
        esc = position_stream[e : e + n_escape * width].tobytes()
        try:
            ranks.append(
                decode_gaps(
                    position_stream[g : g + run_nnz * gap_width], gap_width, esc, width, span, "payload"
                )
            )
        except ValueError as exc:
            raise PayloadError(str(exc)) from None
        g, e = g + run_nnz * gap_width, e + n_escape * width
    flat = positions.class_positions(base_bits, cuts, sizes, ranks) if cuts else ranks[0]
    if flat is None:
        raise PayloadError("payload magnitude classes do not match the anchor bits")
    values = np.frombuffer(value_stream, np.uint8).reshape(4, -1).T.copy().view("<f4").reshape(-1)
    return flat.astype(np.int64, copy=False), values
