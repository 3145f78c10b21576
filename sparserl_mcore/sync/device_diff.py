"""The learner's per-rank diff as a few large torch ops where the weights live (`snapshot="flat"`).

Why: the per-param path (`ShardSyncer._changed` + `layout.to_hf_index` + `per_rank.encode_fragment`)
syncs with the host a few times per parameter (~500 times per sync at 24 layers) and maps and codes
indices on the host. Here, per sync:
1. one compare and one `nonzero` over the rank's owned slices seen as one flat index space: slices
   that lie in one storage (megatron's DDP param buffer, a flat BF16 shadow) are compared as one
   view of it, no copy (`MAX_HOLE`); the snapshot is one flat tensor on the same device;
2. HF coordinates from the layout's segment table, built once (`SegmentLayout.flat_table`): one
   `searchsorted` and a few int64 ops; the changes are put in (tensor, HF index) order by a
   counting placement over the table's rows (no sort);
3. the patch format's gap coding (`encode.encode_gaps`: gap width per tensor, escapes) and the value
   encoding as torch ops, written into one byte buffer at their final offsets;
4. one device-to-host copy of that buffer (~6 bytes per changed element under `sub`/`xor`, ~4
   under `overwrite`, plus a fixed bound for rare escapes); the host hashes the touched values
   (xxh3-128), writes the header and compresses the four streams (zstd) in threads.
The fragment bytes are identical to `per_rank.encode_fragment` over the per-param path's changes
(tests/test_device_diff.py), which stays as the oracle and the `snapshot="host"` / `"device"`
fallback.
"""

from __future__ import annotations

import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.ckpt.layout import FlatTable, SegmentLayout
from sparserl_mcore.sync import flat_host
from sparserl_mcore.sync.decode import decode_gaps
from sparserl_mcore.sync.encode import assemble_patch, plain_entry, worker_count
from sparserl_mcore.sync.hashing import DIGEST_BYTES, touched_digest
from sparserl_mcore.sync.patch_format import VALUE_ENCODINGS, WIDE_GAP_SHARE, CodecConfig, Patch
from sparserl_mcore.sync.per_rank import Change, ModelMeta

# owned slices of one storage at most this many elements apart are compared as one view (the holes,
# e.g. megatron's param padding or a TP replica's norm, map to no HF tensor)
MAX_HOLE = 1 << 16
_META_HEAD = 4  # V (valid changes), G (gap bytes), Es (escape bytes), spare
assert sys.byteorder == "little", "the escape bytes are read from int64 memory as little-endian"


@dataclass(frozen=True)
class Piece:
    """The owned slice [start, end) of param `name`, as a 1-D int16 view (no copy)."""

    name: str
    view: torch.Tensor
    start: int
    end: int


def _runs(pieces: list[Piece]) -> tuple[list[torch.Tensor], list[tuple[str, int, int, int]]]:
    """(views to compare, one per run of nearby slices in one storage; (name, start, end, flat
    offset) of each piece in the runs' concatenated index space)."""
    key = [(p.view.untyped_storage().data_ptr(), int(p.view.storage_offset())) for p in pieces]
    order = sorted((k for k in range(len(pieces)) if pieces[k].end > pieces[k].start), key=key.__getitem__)
    runs: list[torch.Tensor] = []
    placed: list[tuple[str, int, int, int]] = []
    at = length = 0  # flat offset and length of the current run
    first: Piece | None = None
    for k in order:
        piece, (storage, offset) = pieces[k], key[k]
        if first is not None:
            run_start = int(first.view.storage_offset())
            same = storage == first.view.untyped_storage().data_ptr()
            if same and 0 <= offset - (run_start + length) <= MAX_HOLE:
                length = offset + piece.view.numel() - run_start
                placed.append((piece.name, piece.start, piece.end, at + offset - run_start))
                continue
            runs.append(first.view.as_strided((length,), (1,), run_start))
            at += length
        first, length = piece, piece.view.numel()
        placed.append((piece.name, piece.start, piece.end, at))
    if first is not None:
        runs.append(first.view.as_strided((length,), (1,), first.view.storage_offset()))
    return runs, placed


class FlatDiff:
    """Diffs the owned slices against a flat snapshot and codes the changes (module docstring)."""

    def __init__(
        self, layout: SegmentLayout, pieces: list[Piece], shard: tuple[int, ...], encoding: str
    ) -> None:
        if encoding not in VALUE_ENCODINGS:
            raise ValueError(f"encoding={encoding!r} is unknown; choose from {', '.join(VALUE_ENCODINGS)}")
        self.encoding, self.names = encoding, sorted(layout.hf_shapes)
        self.shapes = layout.hf_shapes
        self.runs, placed = _runs(pieces)
        self.table: FlatTable = layout.flat_table(placed, *shard)
        device = self.runs[0].device if self.runs else torch.device("cpu")
        cols = self.table.columns(device)
        rows, tensors = self.table.rows, self.table.tensors
        # HF flat = flat + shift_hf[row] (+ local row x (hf_cols - cols) where a row is narrower than
        # its HF tensor: row-parallel TP shards); holes go to bucket `tensors`, placed last
        self._simple = all(r[3] == r[6] and r[5] == 0 for r in rows)
        self._cols = {
            "start": cols["start"],
            "tensor": torch.where(cols["tensor"] < 0, tensors, cols["tensor"]),
            "shift_hf": cols["hf_col"] - cols["shift"] + cols["row_offset"] * cols["hf_cols"],
            "shift": cols["shift"],
            "cols": cols["cols"],
            "widen": cols["hf_cols"] - cols["cols"],
        }
        self._by_rank = torch.empty_like(cols["hf_rank"])
        self._by_rank[cols["hf_rank"]] = torch.arange(len(rows), device=device)
        touched = {r[7] for r in rows if r[7] >= 0}
        # width-2 escapes need a gap of >= 65535 skipped elements: few, bounded by the tensors' sizes
        self._escape_room = 8 * sum(self._numel(t) // 65535 + 1 for t in touched)
        # escapes are < the largest touched tensor: bytes per escape at most
        top = max((self._numel(t) for t in touched), default=1)
        self._escape_width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
        # the O(numel) compare: torch where the weights live; numpy's chunked compare for host memory
        self.compare = "numpy" if device.type == "cpu" else "torch"
        self.snapshot = torch.cat([r.detach().clone() for r in self.runs]) if self.runs else torch.zeros(0)

    def _numel(self, tensor_id: int) -> int:
        return int(np.prod(self.shapes[self.names[tensor_id]], dtype=np.int64))

    def reset(self) -> None:
        """The snapshot becomes the current weights (after a full sync)."""
        at = 0
        for run in self.runs:
            self.snapshot[at : at + run.numel()].copy_(run)
            at += run.numel()

    def diff(self) -> HostDiff:
        """Changes since the last call (the snapshot moves on): on a device one nonzero and one copy
        to the host (`compare="torch"`); weights in host memory are compared by numpy (`"numpy"`)."""
        if not self.runs:
            return HostDiff.empty(self)
        if self.compare == "numpy":  # whole-array torch ops per change cost more than numpy here
            pos_np, old_np, new_np = flat_host.compare(self.runs, self.snapshot)
            if not pos_np.size:
                return HostDiff.empty(self)
            coded = flat_host.code(self.table, self.names, self.encoding, pos_np, old_np, new_np)
            return HostDiff(self.names, self.shapes, self.encoding, coded.runs, coded.streams, coded.new,
                            coded.lists)  # fmt: skip
        pos, old, new = self._compare()
        if not pos.numel():
            return HostDiff.empty(self)
        return self._gap_code(*self._place(pos, old, new))

    def _compare(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat positions, old, new) of the changed elements; the snapshot moves on."""
        snap = self.snapshot
        if len(self.runs) == 1:
            cur = self.runs[0]
            pos = (cur != snap).nonzero().squeeze(1)
            old, new = snap[pos], cur[pos]
            snap[pos] = new
        else:
            mask = torch.empty(snap.numel(), dtype=torch.bool, device=snap.device)
            at = 0
            for run in self.runs:
                torch.ne(run, snap[at : at + run.numel()], out=mask[at : at + run.numel()])
                at += run.numel()
            pos = mask.nonzero().squeeze(1)
            old = snap[pos]
            self.reset()
            new = snap[pos]
        return pos, old, new

    def _place(self, pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Map and order the N changes: (tensor id, HF index, changes per tensor, old, new), in
        (tensor, HF index) order, holes (tensor id `tensors`) last."""
        c, n_all = self._cols, pos.numel()
        row = torch.searchsorted(c["start"], pos, right=True) - 1
        hf = pos + c["shift_hf"][row]
        if not self._simple:
            local_row = (pos - c["shift"][row]).div(c["cols"][row], rounding_mode="floor")
            hf += local_row * c["widen"][row]
        # changes per table row, placed in (tensor, HF index) order: rows in hf_rank order, each
        # row's changes in flat order (a row is increasing in HF order)
        first = torch.searchsorted(pos, c["start"])
        count = torch.cat((first[1:], first.new_full((1,), n_all))) - first
        ranked = count[self._by_rank]
        place = torch.empty_like(first)
        place[self._by_rank] = torch.cumsum(ranked, 0) - ranked
        dest = (place - first)[row] + torch.arange(n_all, device=pos.device)
        t_s, hf_s = torch.empty_like(row), torch.empty_like(hf)
        t_s[dest], hf_s[dest] = c["tensor"][row], hf
        old_s, new_s = torch.empty_like(old), torch.empty_like(new)
        old_s[dest], new_s[dest] = old, new
        per_tensor = torch.zeros(self.table.tensors + 1, dtype=torch.int64, device=pos.device)
        n = per_tensor.index_add_(0, c["tensor"], count)
        return t_s, hf_s, n, old_s, new_s

    def _gap_code(
        self, t: torch.Tensor, hf: torch.Tensor, n: torch.Tensor, old: torch.Tensor, new: torch.Tensor
    ) -> HostDiff:
        """`encode.encode_gaps` per tensor and the value encoding, written into one byte buffer at
        their final offsets, and its copy to the host. `n`: changes per tensor (+ holes, last)."""
        n_all, tensors, dev = t.numel(), self.table.tensors, t.device
        i64 = torch.int64
        real = torch.arange(tensors + 1, device=dev) < tensors

        def per_tensor(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(tensors + 1, dtype=i64, device=dev).scatter_add_(0, t, values)

        start = torch.cumsum(n, 0) - n
        gap = torch.empty(n_all + 1, dtype=i64, device=dev)  # the last entry: writes to nowhere
        gap[0] = hf[0]
        torch.sub(hf[1:], hf[:-1], out=gap[1:n_all]).sub_(1)
        gap[torch.where(n > 0, start, n_all)] = torch.cat((hf, hf[:1]))[start.clamp(max=n_all)]
        gap = gap[:n_all]
        gw_t = torch.where(per_tensor((gap >= 255).to(i64)).double() >= WIDE_GAP_SHARE * n.double(), 2, 1)
        escape_t = torch.where(real, (1 << (8 * gw_t)) - 1, 1 << 62)  # holes never escape
        escape = escape_t[t]
        big = gap >= escape
        extra = torch.where(big, gap - escape, 0)
        esc_t = per_tensor(big.to(i64))
        top = torch.zeros(tensors + 1, dtype=i64, device=dev).scatter_reduce_(0, t, extra, "amax")
        ew_t = torch.where(top < 1 << 8, 1, torch.where(top < 1 << 16, 2, torch.where(top < 1 << 32, 4, 8)))
        ew_t = torch.where(esc_t == 0, 0, ew_t)
        gap_bytes = torch.where(real, n * gw_t, 0)
        total_gaps = gap_bytes.sum()
        esc_bytes = esc_t * ew_t
        esc_at = total_gaps + torch.cumsum(esc_bytes, 0) - esc_bytes

        needs_base = VALUE_ENCODINGS[self.encoding].needs_base
        head = 8 * (_META_HEAD + 4 * tensors)
        planes = head
        new_at = planes + 2 * n_all
        region = new_at + (2 * n_all if needs_base else 0)
        size = region + 2 * n_all + self._escape_room
        # past `size` (never copied): 8 bytes where suppressed writes go, then one byte per hole
        buf = torch.empty(size + 8 + n_all, dtype=torch.uint8, device=dev)
        gap_at = torch.where(real, torch.cumsum(gap_bytes, 0) - gap_bytes, size + 8 - region)
        # element i of tensor k: low byte at gap_at[k] + (i - start[k]), high byte n[k] further for
        # two-byte gaps; one-byte gaps write their (zero) high byte where the low byte then lands
        low_at = region + (gap_at - start)[t] + torch.arange(n_all, device=dev)
        small = torch.minimum(gap, escape)
        buf[low_at + torch.where(real & (gw_t == 2), n, 0)[t]] = (small >> 8).to(torch.uint8)
        buf[low_at] = small.to(torch.uint8)
        # escapes: the r-th escape of tensor k at esc_at[k] + r * ew[k], little-endian; bytes past
        # a tensor's width land on later escapes' bytes (or past the stream), which the passes for
        # lower bytes then overwrite: so the passes run from the highest byte down
        ew = ew_t[t]
        rank = torch.cumsum(big.to(i64), 0) - 1
        first_at = region + esc_at - (torch.cumsum(esc_t, 0) - esc_t) * ew_t
        base = torch.where(big, first_at[t] + rank * ew, size)
        extra_bytes = extra.view(torch.uint8).view(n_all, 8)  # little-endian (x86, CUDA)
        for byte in reversed(range(self._escape_width)):
            buf[base + byte] = extra_bytes[:, byte]
        stored = _stored(self.encoding, old.to(torch.int32) & 0xFFFF, new.to(torch.int32) & 0xFFFF)
        buf[planes : planes + n_all] = stored.to(torch.uint8)
        buf[planes + n_all : planes + 2 * n_all] = (stored >> 8).to(torch.uint8)
        if needs_base:
            buf[new_at : new_at + 2 * n_all].view(torch.int16).copy_(new)
        meta = torch.cat((torch.stack((n[:tensors].sum(), total_gaps, esc_bytes.sum(), total_gaps * 0)),
                          n[:tensors], gw_t[:tensors], ew_t[:tensors], esc_t[:tensors]))  # fmt: skip
        buf[:head].view(i64).copy_(meta)
        # the sync's one device-to-host copy (into pinned memory on CUDA: non_blocking, then waited
        # for); a fresh host buffer each time, so a HostDiff stays valid after the next diff
        host = buf[:size].to("cpu", non_blocking=True, copy=True)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        return HostDiff.parse(self, host.numpy(), n_all, needs_base)


def _stored(encoding: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`VALUE_ENCODINGS[encoding].encode` on int32 holders of uint16 bit patterns."""
    if encoding == "overwrite":
        return new
    if encoding == "xor":
        return old ^ new
    d = (new - old) & 0xFFFF
    d = d - ((d >> 15) << 16)  # the int16 delta
    return ((d << 1) ^ (d >> 15)) & 0xFFFF


@dataclass(frozen=True)
class HostDiff:
    """One sync's coded changes on the host: per tensor (ascending id) the run fields, and the raw
    streams; `fragment` frames them, `changes` decodes them into `per_rank.Change`s."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    encoding: str
    runs: list[tuple[int, list[int]]]  # (tensor id, [nnz, gap width, escape width, escapes])
    streams: list[np.ndarray]  # gaps, escapes, values lo, values hi
    new: np.ndarray  # uint16 new bits, in stream order
    lists: list[Change] | None = None  # coded on the host: the changes as lists too

    @classmethod
    def empty(cls, diff: FlatDiff) -> HostDiff:
        none = np.zeros(0, np.uint8)
        return cls(diff.names, diff.shapes, diff.encoding, [], [none] * 4, np.zeros(0, np.uint16))

    @classmethod
    def parse(cls, diff: FlatDiff, host: np.ndarray, n_all: int, needs_base: bool) -> HostDiff:
        tensors = diff.table.tensors
        head = 8 * (_META_HEAD + 4 * tensors)
        meta = np.frombuffer(host[:head].tobytes(), "<i8")
        valid, gaps, escapes = (int(v) for v in meta[:3])
        n, gw, ew, esc = meta[_META_HEAD:].reshape(4, tensors)
        lo, hi = host[head : head + valid], host[head + n_all : head + n_all + valid]
        if needs_base:
            new = host[head + 2 * n_all : head + 2 * n_all + 2 * valid].view("<u2")
        else:
            new = np.empty(valid, "<u2")
            new.view(np.uint8)[0::2], new.view(np.uint8)[1::2] = lo, hi
        region = head + (4 if needs_base else 2) * n_all
        streams = [host[region : region + gaps], host[region + gaps : region + gaps + escapes], lo, hi]
        runs = [(int(k), [int(n[k]), int(gw[k]), int(ew[k]), int(esc[k])]) for k in np.flatnonzero(n)]
        return cls(diff.names, diff.shapes, diff.encoding, runs, streams, new)

    def fragment(
        self,
        meta: ModelMeta,
        *,
        version: int,
        base_version: int,
        fragment: tuple[int, int],
        codec: CodecConfig | None = None,
    ) -> bytes:
        """The bytes `per_rank.encode_fragment` writes for these changes (a sparse fragment)."""
        codec = codec or CodecConfig()
        if codec.encoding != self.encoding:
            raise ValueError(f"the diff was coded for encoding {self.encoding!r}, not {codec.encoding!r}")
        entries, at = [], 0
        for tensor, run in self.runs:
            name = self.names[tensor]
            digest = touched_digest(self.new[at : at + run[0]])
            entries.append(plain_entry(name, meta.dtype, tuple(meta.shapes[name]), run, digest))
            at += run[0]
        patch = Patch(
            version=version,
            base_version=base_version,
            anchor_version=base_version,
            model_digest=bytes(DIGEST_BYTES),
            model_tensors=meta.tensors,
            model_numel=meta.numel,
            tensors=(),
            fragment=fragment,
            digest_scope="touched",
        )
        config = dataclasses.replace(codec, position_model="plain")
        with ThreadPoolExecutor(worker_count()) as pool:
            return assemble_patch(patch, entries, self.streams, config, pool)

    def changes(self) -> list[Change]:
        """(HF name, indices, old bits or None under `overwrite`, new bits) per touched tensor."""
        if self.lists is not None:
            return self.lists
        out: list[Change] = []
        gaps, escapes, lo, hi = self.streams
        stored = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
        at = gap_at = esc_at = 0
        for tensor, (nnz, width, esc_width, n_esc) in self.runs:
            name = self.names[tensor]
            numel = int(np.prod(self.shapes[name], dtype=np.int64))
            planes = gaps[gap_at : gap_at + nnz * width]
            esc = escapes[esc_at : esc_at + n_esc * esc_width].tobytes()
            indices = decode_gaps(planes, width, esc, esc_width, numel, name)
            new = self.new[at : at + nnz].astype(np.uint16)
            out.append((name, indices, _old_bits(self.encoding, stored[at : at + nnz], new), new))
            at, gap_at, esc_at = at + nnz, gap_at + nnz * width, esc_at + n_esc * esc_width
        return out


def _old_bits(encoding: str, stored: np.ndarray, new: np.ndarray) -> np.ndarray | None:
    """The base bits behind `stored` (None under `overwrite`: it does not carry them)."""
    if encoding == "overwrite":
        return None
    if encoding == "xor":
        return stored ^ new
    delta = (stored >> 1).astype(np.int32) ^ -(stored & 1).astype(np.int32)
    return ((new.astype(np.int32) - delta) & 0xFFFF).astype(np.uint16)
