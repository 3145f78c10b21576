"""Position classes conditioned on the base weights (the `base` position model of patch format 3).

Why: at RL learning rates an Adam step moves a weight by about lr, and its BF16 pattern flips only
when that crosses a rounding boundary, i.e. with probability ~ lr / ulp(w); the ulp is set by the
exponent. So small-magnitude weights flip far more often than large ones, and the receiver already
holds every base value exactly (delta patches apply to a named, digest-verified base). Splitting a
tensor's elements into a few magnitude classes by cuts on |base bits| (`cuts`, ascending) and coding
each class's changed positions as gaps among that class's elements costs ~ sum of nnz_c x H(p_c) / p_c
bits instead of nnz x H(p) / p: near nothing for classes that (almost) all flip or none do.

Class c of an element is the number of cuts <= its magnitude bits (`bits & 0x7fff`). The lower
classes are listed (ascending flat indices) on both sides and their changes coded as ranks in
them; the last class (at or above every cut) is the bulk, never listed, whose changes keep flat
indices. Cost per tensor and side: one chunked O(numel) pass (~0.2-0.45 ns per element) plus
~20-30 ns per listed element (docs/sync.md, "What the position model costs").
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

MAX_CLASSES = 4
# the lower classes may hold at most this share of a tensor: bounds the listed arrays (int64 index
# and an int32 count per lower class: <= 20 bytes per listed element) and the work on them.
# Mid-training bench at 99.3-99.5 %: 1/4 and 1/16 within 0.6 % in size, 1/64 +1.2-2.5 %.
_MAX_LOW_SHARE = 1 / 16
# keep the plain model unless the estimated saving beats the header fields the classes cost
_MIN_SAVING_BITS = 8 * 32
# cuts sit on exponent boundaries (mantissa 0): mag bits < 0x7f80 are the finite magnitudes
MAX_CUT = 0x7F80
# Quick bench shape (12M elements), mid-training master at 99.4 %, encode / resolve on a shared box:
# plain 1.554 B/changed, 2 / 3 ms; 0 -> 1.208, 39-63 / 29-46 ms; 0.5 -> 1.274, 27-39 / 15-23 ms;
# 1 -> 1.283, 26-33 / 14-18 ms (fresh-master steps: 0.344 for all three). Rechecked after the
# listing got cheaper (bench_sync_positions, 151M elements, 99.5 %, extra ns/element encode / resolve):
# 0.5 -> 1.180 B/changed, 0.67 / 0.72; 0.25 -> 1.178, 1.04 / 0.83; 0 -> 1.045, 1.53 / 1.51
_LISTED_BITS = 0.5
# chunk of the O(numel) compare: cache-sized buffers instead of numel-sized temporaries
_CHUNK = 1 << 18
# encoder histograms come from ~this many evenly spaced elements (an estimate only)
_SAMPLE = 1 << 14


def _binary_entropy_bits(k: np.ndarray | np.float64, n: np.ndarray | np.float64) -> np.ndarray:
    """n x H(k / n): the bits needed to say which k of n elements changed (0 where k = 0 or n)."""
    p = np.divide(k, n, out=np.zeros_like(k), where=n > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return n * h


def choose_cuts(base_bits: np.ndarray, old_changed: np.ndarray) -> tuple[int, ...]:
    """Magnitude cuts (up to MAX_CLASSES - 1) minimising the estimated position bits, or () (plain).

    `base_bits`: the tensor's flat bits (a sample is read); `old_changed`: the base bits of the
    changed elements. Optimal over exponent boundaries by dynamic programming on the distinct
    exponents present (a few dozen), so it costs ~nothing next to the compare.
    """
    numel = base_bits.size
    if _binary_entropy_bits(np.float64(old_changed.size), np.float64(numel)) <= _MIN_SAVING_BITS:
        return ()  # the plain positions cost less than the classes could save
    stride = max(1, numel // _SAMPLE) | 1  # odd: no aliasing with power-of-two row lengths
    sample = base_bits[::stride]
    changed = np.bincount((old_changed >> 7) & 0xFF, minlength=256).astype(np.float64)
    every = np.bincount((sample >> 7) & 0xFF, minlength=256) * (numel / sample.size)
    every = np.maximum(every, changed)  # the sample is an estimate; the changed counts are exact
    # class boundaries worth considering: exponents present, with at most the listed share below
    under = np.cumsum(every) - every
    edges = np.flatnonzero(((every > 0) | (changed > 0)) & (under <= _MAX_LOW_SHARE * numel))
    if edges.size < 2:
        return ()
    bounds = np.append(edges, 256)  # group g covers exponents [bounds[g], bounds[g + 1])
    n_all = np.concatenate(([0.0], np.cumsum(every[edges])))
    n_chg = np.concatenate(([0.0], np.cumsum(changed[edges])))
    # cost[a, b]: bits for the class made of groups a..b-1
    cost = _binary_entropy_bits(n_chg[None, :] - n_chg[:, None], n_all[None, :] - n_all[:, None])
    groups = edges.size
    invalid = np.tril(np.ones((groups + 1, groups + 1), bool))
    cost = np.where(invalid, np.inf, cost)
    # every element of a lower class is listed by the encoder and the decoder (~20-30 ns each,
    # mostly numpy's nonzero), so charge it as bits: bytes traded against time
    cost[:, :groups] += _LISTED_BITS * (n_all[None, :groups] - n_all[:, None])
    best = np.full((MAX_CLASSES + 1, groups + 1), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((MAX_CLASSES + 1, groups + 1), np.int64)
    for k in range(1, MAX_CLASSES + 1):
        total = best[k - 1][:, None] + cost
        back[k], best[k] = total.argmin(0), total.min(0)
    k = int(np.argmin(best[1:, groups])) + 1
    if not best[1, groups] - best[k, groups] > _MIN_SAVING_BITS:
        return ()
    starts, b = [], groups
    for level in range(k, 0, -1):
        b = int(back[level, b])
        starts.append(b)
    return tuple(int(bounds[s]) << 7 for s in sorted(starts) if s > 0)


def _classes(mags: np.ndarray, cuts: tuple[int, ...]) -> np.ndarray:
    """Class of each magnitude: the number of cuts at or below it (a few compares beat a search)."""
    out = np.zeros(mags.size, np.uint8)
    for cut in cuts:
        out += mags >= cut
    return out


def _scan(
    bits: np.ndarray, top: int, with_mags: bool, lo: int, hi: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ascending flat indices in [lo, hi) with magnitude bits < top, their magnitude bits if asked)
    in chunks: cache-sized buffers instead of numel-sized temporaries."""
    buf, mask = np.empty(_CHUNK, np.uint16), np.empty(_CHUNK, bool)
    found, mags = [], []
    for start in range(lo, hi, _CHUNK):
        n = min(_CHUNK, hi - start)
        np.bitwise_and(bits[start : start + n], 0x7FFF, out=buf[:n])
        np.less(buf[:n], np.uint16(top), out=mask[:n])
        hits = np.flatnonzero(mask[:n])  # ~0.2 ns per element plus ~20 per hit: most of the cost
        if hits.size:
            if with_mags:
                mags.append(buf[hits])
            hits += start
            found.append(hits)
    return found, mags


class _Listed:
    """The lower classes of one tensor: their elements' ascending flat indices (`low`) and, with
    several lower classes, per class the count of its elements in low[:k] for every k (`before`,
    int32, leading 0). Running counts are branch-free numpy work (~1 ns per listed element and
    class) where selecting each class's elements costs ~20 ns per element."""

    def __init__(self, bits: np.ndarray, cuts: tuple[int, ...]) -> None:
        # contiguous spans of whole chunks, one per thread (numpy releases the GIL in these loops);
        # >= 16 chunks each: measured 0.45 ns per element on one thread vs 0.50 on two at 4.4M
        # elements (pool start-up), 0.44 vs 0.27 at 136M
        threads = max(1, min(torch.get_num_threads(), bits.size // (16 * _CHUNK)))
        edges = [bits.size * t // threads // _CHUNK * _CHUNK for t in range(threads)] + [bits.size]
        spans = [(bits, cuts[-1], len(cuts) > 1, lo, hi) for lo, hi in itertools.pairwise(edges)]
        if threads == 1:
            parts = [_scan(*spans[0])]
        else:
            with ThreadPoolExecutor(threads) as pool:
                parts = list(pool.map(lambda span: _scan(*span), spans))
        found = [hits for part_hits, _ in parts for hits in part_hits]
        self.low = np.concatenate(found) if found else np.zeros(0, np.int64)
        self.before: list[np.ndarray] = []
        if len(cuts) > 1:
            mags = [m for _, part_mags in parts for m in part_mags]
            low_class = _classes(np.concatenate(mags) if mags else np.zeros(0, np.uint16), cuts)
            for c in range(len(cuts)):
                count = np.zeros(self.low.size + 1, np.int32)
                np.cumsum(low_class == c, out=count[1:])
                self.before.append(count)

    def size(self, c: int) -> int:
        return int(self.before[c][-1]) if self.before else int(self.low.size)

    def rank(self, c: int, indices: np.ndarray) -> np.ndarray:
        """How many class-c elements lie before each of `indices` (ascending)."""
        at = np.searchsorted(self.low, indices)
        return self.before[c][at].astype(np.int64) if self.before else at

    def flat(self, c: int, ranks: np.ndarray) -> np.ndarray:
        """Flat indices of the class-c elements with these ranks (ascending, each < size(c))."""
        if not self.before:
            return self.low[ranks]
        # int32 keys: int64 ones would make searchsorted copy `before` to int64
        return self.low[np.searchsorted(self.before[c], (ranks + 1).astype(np.int32)) - 1]


def class_ranks(
    indices: np.ndarray,
    old_bits: np.ndarray,
    new_bits: np.ndarray,
    base_bits: np.ndarray,
    cuts: tuple[int, ...],
) -> tuple[list[np.ndarray], np.ndarray, list[int]]:
    """(per class, the ascending positions to code: ranks among the class's elements for the lower
    classes, flat indices for the bulk; class-major order of the changes; class sizes).
    `base_bits` may be the tensor before or after the change (`old_bits` -> `new_bits` at
    `indices`): only unchanged positions are read from it."""
    listed = _Listed(base_bits, cuts)
    changed_class = _classes(old_bits & 0x7FFF, cuts)
    # a change that crossed a cut is counted in the wrong class where base_bits holds the new value:
    # correct ranks and sizes by those (~1 % of the changes; only they are read from base_bits)
    crossed = np.flatnonzero(_classes(new_bits & 0x7FFF, cuts) != changed_class)
    listed_class = changed_class.copy()
    listed_class[crossed] = _classes(base_bits[indices[crossed]] & 0x7FFF, cuts)
    moved = crossed[listed_class[crossed] != changed_class[crossed]]
    # class-major order of the changes: one radix sort (uint8 keys) instead of a selection per class
    order = np.argsort(changed_class, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(changed_class, minlength=len(cuts) + 1))))
    in_class = [indices[order[bounds[c] : bounds[c + 1]]] for c in range(len(cuts) + 1)]
    ranks, sizes = [], []
    for c, mine in enumerate(in_class[:-1]):
        rank, size = listed.rank(c, mine), listed.size(c)
        if moved.size:
            gone = indices[moved[listed_class[moved] == c]]
            came = indices[moved[changed_class[moved] == c]]
            rank += np.searchsorted(came, mine) - np.searchsorted(gone, mine)
            size += came.size - gone.size
        ranks.append(rank)
        sizes.append(size)
    # the bulk keeps flat indices: ranks among its elements would save ~log2(1 / (1 - 1/16)) bits
    # per gap at most and cost a binary search per change; the decoder checks their class instead
    ranks.append(in_class[-1])
    sizes.append(int(base_bits.size - sum(sizes)))
    return ranks, order, sizes


def class_positions(
    base_bits: np.ndarray, cuts: tuple[int, ...], sizes: list[int], ranks: list[np.ndarray]
) -> np.ndarray | None:
    """Flat indices, class-major, of per-class positions (`class_ranks`) against the receiver's
    base bits; None when the base's classes differ from the encoder's (a wrong or corrupt base)."""
    listed = _Listed(base_bits, cuts)
    bulk = ranks[-1]
    counts = [listed.size(c) for c in range(len(cuts))]
    if [*counts, base_bits.size - sum(counts)] != list(sizes) or bulk.size and bulk.max() >= base_bits.size:
        return None
    if ((base_bits[bulk] & 0x7FFF) < cuts[-1]).any():
        return None
    out = [listed.flat(c, r) for c, r in enumerate(ranks[:-1])]
    out.append(bulk)
    return np.concatenate(out)
