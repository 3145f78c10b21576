"""The host coder of the flat diff (`sync.flat_host`): its per-tensor gap streams against
`encode.encode_gaps` at the edges of the format (a single index, exactly 1/8 of the gaps too wide
for a byte, two-byte gaps with escapes of 1, 2 and 4 bytes), and the compare that moves the
snapshot on in cache. Whole fragments against `encode_fragment`: tests/test_device_diff.py."""

from __future__ import annotations

import numpy as np
import torch

from sparserl_mcore.sync import flat_host
from sparserl_mcore.sync.encode import encode_gaps


def _indices(gaps: list[int]) -> np.ndarray:
    return np.cumsum(np.array(gaps, np.int64) + 1) - 1


def test_gap_streams_match_encode_gaps():
    rng = np.random.default_rng(0)
    cases = [
        _indices([0]),
        _indices([7]),
        _indices([3, 1, 1, 1, 1, 1, 1, 300]),  # exactly 1/8 of the gaps >= 255: two-byte gaps
        _indices([3, 1, 1, 1, 1, 1, 1, 1, 300]),  # just under 1/8: one-byte gaps, one escape
        _indices([400, 70_000, 2, 300, 90_000]),  # two-byte gaps, two-byte escapes
        _indices([1, 1 << 26, 5]),  # a four-byte escape
        np.sort(rng.choice(1 << 20, 5000, replace=False)),  # sparse: mostly two-byte gaps
        np.sort(rng.choice(1 << 16, 20_000, replace=False)),  # dense: one-byte gaps
    ]
    hf = np.concatenate(cases)
    bounds = np.cumsum([0] + [c.size for c in cases])
    tensors = [[3 * k, int(a), int(b)] for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))]
    gaps, escapes, runs = flat_host._gaps(hf, tensors)
    want = [encode_gaps(c) for c in cases]
    assert [r for _, r in runs] == [[c.size, w[1], w[3], w[4]] for c, w in zip(cases, want, strict=True)]
    assert [t for t, _ in runs] == [t for t, _, _ in tensors]
    assert gaps.tobytes() == b"".join(w[0] for w in want)
    assert escapes.tobytes() == b"".join(w[2] for w in want)
    assert {w[1] for w in want} == {1, 2} and {w[3] for w in want} >= {1, 2, 4}  # every width ran


def test_compare_moves_the_snapshot_on():
    gen = torch.Generator().manual_seed(0)
    weights = torch.randint(-30000, 30000, (3 << 17,), generator=gen, dtype=torch.int16)
    snapshot = weights.clone()
    changed = torch.randperm(weights.numel(), generator=gen)[:4000].sort().values
    weights[changed] += 1
    runs = [weights[: 1 << 17], weights[(1 << 17) + 5 :]]  # two runs, a hole of 5 between
    snap = torch.cat([snapshot[: 1 << 17], snapshot[(1 << 17) + 5 :]])
    want = (torch.cat(runs) != snap).nonzero().squeeze(1)
    pos, old, new = flat_host.compare(runs, snap)
    flat = torch.cat(runs)
    assert np.array_equal(pos, want.numpy())
    assert np.array_equal(new, flat.numpy().view(np.uint16)[pos])
    assert not np.array_equal(old, new)
    assert torch.equal(snap, flat)  # moved on: the next compare finds nothing
    assert flat_host.compare(runs, snap)[0].size == 0
