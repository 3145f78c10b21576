"""The flat diff's host variant (`FlatDiff.compare = "numpy"`: weights in host memory, a CPU learner).

The device coder's ~60 whole-array torch ops per change cost 3-7x more than numpy on a CPU, and
`per_rank.encode_fragment` over per-row lists concatenates, sorts and gathers every tensor's
changes again before copying them into the body streams. Here each change is written once into its
final place:
1. `compare`: `diff.py`'s chunked numpy compare in a thread pool (the mask and its nonzero stay in
   cache); the snapshot takes the new values chunk by chunk while the chunk is in cache;
2. `code`: per table row in `FlatTable.hf_rank` order, one add maps the row's changes to HF indices,
   written straight into (tensor, HF index) order (rows of one tensor never interleave in HF order);
   then per tensor the gaps, escapes and gap width of `encode.encode_gaps`, and the value encoding
   and its two byte planes over all changes at once.
Fragments framed from the result are byte-identical to `encode_fragment`'s (tests/test_device_diff.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sparserl_mcore.ckpt.layout import FlatTable
from sparserl_mcore.sync.diff import changed_bits_in
from sparserl_mcore.sync.encode import worker_count
from sparserl_mcore.sync.patch_format import VALUE_ENCODINGS, WIDE_GAP_SHARE, WIDTHS, gap_escape
from sparserl_mcore.sync.per_rank import Change


def compare(runs: list[torch.Tensor], snapshot: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat positions, old bits, new bits) where the runs (host int16 views) differ from the flat
    snapshot, which moves on to them."""
    snap = snapshot.numpy().view(np.uint16)
    found, at = [], 0
    with ThreadPoolExecutor(worker_count()) as pool:
        for run in runs:
            n = run.numel()
            idx, old, new = changed_bits_in(pool, snap[at : at + n], run.numpy().view(np.uint16), move=True)
            found.append((idx + at if at else idx, old, new))
            at += n
    if len(found) == 1:
        return found[0]
    pos, old_bits, new_bits = (np.concatenate([f[k] for f in found]) for k in range(3))
    return pos, old_bits, new_bits


@dataclass(frozen=True)
class Coded:
    """One diff coded as `device_diff.HostDiff` holds it: runs and streams in ascending tensor id,
    the new bits in stream order, and the changes as lists (views, for `HostDiff.changes`)."""

    runs: list[tuple[int, list[int]]]
    streams: list[np.ndarray]
    new: np.ndarray
    lists: list[Change]


def code(
    table: FlatTable, names: list[str], encoding: str, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> Coded:
    """The changes at flat positions `pos` (ascending) coded per HF tensor (module docstring)."""
    rows = table.rows
    first = np.searchsorted(pos, [r[0] for r in rows])
    last = np.append(first[1:], pos.size)
    order = [k for k in sorted(range(len(rows)), key=table.hf_rank.__getitem__)
             if rows[k][7] >= 0 and last[k] > first[k]]  # fmt: skip
    total = int(sum(last[k] - first[k] for k in order))
    hf = np.empty(total, np.int64)
    keep_old = encoding != "overwrite"
    new_s = np.empty(total, np.uint16)
    old_s = np.empty(total, np.uint16) if keep_old else new_s
    tensors: list[list[int]] = []  # [tensor id, start, end] in stream order
    at = 0
    for k in order:
        _, _, shift, cols, row_offset, hf_col, hf_cols, tensor = rows[k]
        a, b = int(first[k]), int(last[k])
        end = at + b - a
        out = hf[at:end]
        np.add(pos[a:b], hf_col + row_offset * hf_cols - shift, out=out)
        if cols != hf_cols:  # a row narrower than its HF tensor (row-parallel TP shard)
            out += (pos[a:b] - shift) // cols * (hf_cols - cols)
        new_s[at:end] = new[a:b]
        if keep_old:
            old_s[at:end] = old[a:b]
        if tensors and tensors[-1][0] == tensor:
            tensors[-1][2] = end
        else:
            tensors.append([tensor, at, end])
        at = end
    stored = VALUE_ENCODINGS[encoding].encode(old_s, new_s).astype("<u2", copy=False)
    planes = stored.view(np.uint8).reshape(-1, 2).T.copy()  # values lo, values hi
    gaps, escapes, runs = _gaps(hf, tensors)
    lists = [(names[t], hf[a:b], old_s[a:b] if keep_old else None, new_s[a:b]) for t, a, b in tensors]
    return Coded(runs, [gaps, escapes, planes[0], planes[1]], new_s, lists)


def _gaps(hf: np.ndarray, tensors: list[list[int]]) -> tuple[np.ndarray, np.ndarray, list]:
    """(gap stream, escape stream, runs) of `encode.encode_gaps` per tensor slice of `hf`."""
    gaps = np.empty(hf.size, np.int64)
    np.subtract(hf[1:], hf[:-1], out=gaps[1:])
    gaps -= 1
    starts = np.array([a for _, a, _ in tensors], np.int64)
    gaps[starts] = hf[starts]
    wide = gaps >= gap_escape(1)  # the one-byte escapes, and what decides the width
    stream = np.empty(2 * hf.size, np.uint8)  # room for two-byte gaps everywhere
    escapes: list[bytes] = []
    runs: list[tuple[int, list[int]]] = []
    at = 0
    for tensor, a, b in tensors:
        g, n = gaps[a:b], b - a
        n_wide = int(np.count_nonzero(wide[a:b]))
        width = 2 if n_wide >= WIDE_GAP_SHARE * n else 1
        escape = gap_escape(width)
        big = wide[a:b] if width == 1 else g >= escape
        n_escape = n_wide if width == 1 else int(np.count_nonzero(big))
        esc_width = 0
        if n_escape:
            extra = g[big] - escape
            top = int(extra.max())
            esc_width = next(w for w in WIDTHS if top < 1 << (8 * w))
            escapes.append(extra.astype(f"<u{esc_width}").tobytes())
        if width == 1:
            np.minimum(g, escape, out=stream[at : at + n], casting="unsafe")
        else:
            small = np.minimum(g, escape).astype("<u2")
            stream[at : at + n] = small.view(np.uint8)[0::2]
            stream[at + n : at + 2 * n] = small.view(np.uint8)[1::2]
        runs.append((tensor, [n, width, esc_width, n_escape]))
        at += width * n
    return stream[:at], np.frombuffer(b"".join(escapes), np.uint8), runs
