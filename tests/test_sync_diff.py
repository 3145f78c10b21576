"""make_patch's chunked, threaded diff against an independent whole-tensor reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparserl_mcore.sync import diff
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.hashing import tensor_digest


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Sizes around the chunk (64) and piece (256) boundaries set below; changes at both ends."""
    gen = torch.Generator().manual_seed(3)
    old, new = {}, {}
    for name, numel, density in [
        ("big", 1000, 0.1),
        ("piece_plus_one", 257, 0.3),
        ("one_chunk", 64, 1.0),
        ("single", 1, 1.0),
        ("empty", 0, 0.0),
        ("same", 300, 0.0),
        ("ends_only", 513, 0.0),
    ]:
        t = (torch.randn(numel, generator=gen) * 0.02).bfloat16()
        bits = t.view(torch.int16).clone()
        moved = torch.rand(numel, generator=gen) < density
        if name == "ends_only":
            moved[[0, 255, 256, 511, 512]] = True
        bits[moved] += torch.randint(1, 3, (int(moved.sum()),), generator=gen, dtype=torch.int16)
        old[name], new[name] = t, bits.view(torch.bfloat16)
    return old, new


@pytest.fixture()
def small_steps(monkeypatch):
    monkeypatch.setattr(diff, "_CHUNK", 64)
    monkeypatch.setattr(diff, "_PIECE", 256)


def test_chunked_diff_matches_whole_tensor_reference(small_steps):
    old, new = _states()
    patch = diff.make_patch(old, new, version=1, base_version=0, anchor_version=0)
    found = {c.name: c for c in patch.tensors}
    for name in old:
        o, n = old[name].view(torch.int16), new[name].view(torch.int16)
        at = torch.nonzero(o != n).flatten()
        if not at.numel():
            assert name not in found
            continue
        change = found[name]
        assert np.array_equal(change.indices, at.numpy())
        assert np.array_equal(change.old_bits, o[at].numpy().view(np.uint16))
        assert np.array_equal(change.new_bits, n[at].numpy().view(np.uint16))
        assert change.digest == tensor_digest(new[name])
    assert [c.name for c in patch.tensors] == [n for n in old if n in found]  # state-dict order


def test_bytes_do_not_depend_on_steps_or_threads(small_steps, monkeypatch):
    old, new = _states()
    small = encode_patch(diff.make_patch(old, new, version=1, base_version=0, anchor_version=0))
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = encode_patch(diff.make_patch(old, new, version=1, base_version=0, anchor_version=0))
    finally:
        torch.set_num_threads(threads)
    assert small == serial
