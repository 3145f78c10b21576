"""Directory transport: chain replay, anchors, late joiners, and full-sync fallback on bad patches."""

from __future__ import annotations

import torch

from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import CodecConfig, encode_patch
from sparserl_mcore.sync.diff import full_patch, make_patch
from sparserl_mcore.sync.transport_dir import (
    DirectoryConfig,
    DirectoryPublisher,
    DirectorySubscriber,
    read_manifest,
)


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    master = {"w": torch.randn(64, 48, generator=gen) * 0.02, "b": torch.randn(300, generator=gen) * 0.02}
    out = []
    for _ in range(n):
        out.append({k: v.bfloat16() for k, v in master.items()})
        for v in master.values():
            v -= 5e-5 * torch.randn(v.shape, generator=gen).sign()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


def _publish(pub: DirectoryPublisher, states, version: int) -> None:
    state = states[version]
    parts = []
    if version > 0:
        patch = make_patch(
            states[version - 1],
            state,
            version=version,
            base_version=version - 1,
            anchor_version=pub.last_anchor() or 0,
        )
        parts = [encode_patch(patch, CodecConfig(encoding="xor"))]
    pub.publish(
        version=version,
        base_version=version - 1 if version else None,
        parts=parts,
        full=lambda: encode_patch(full_patch(state, version=version)),
    )


def _blank(states) -> HFReceiver:
    return HFReceiver({k: torch.zeros_like(v) for k, v in states[0].items()}, version=None)


def test_chain_replay_with_anchors_is_exact(tmp_path):
    states = _versions(26)
    pub = DirectoryPublisher(tmp_path, DirectoryConfig(anchor_every=10, keep_anchors=2))
    follower = DirectorySubscriber(tmp_path, _blank(states))
    for v in range(26):
        _publish(pub, states, v)
        if v % 3 == 0:  # polls now and then: replays several versions at once
            assert follower.poll() == v and _same(follower.receiver.state, states[v])
        if v == 14:
            joiner_14 = DirectorySubscriber(tmp_path, _blank(states))
            assert joiner_14.poll() == 14 and _same(joiner_14.receiver.state, states[14])
    manifest = read_manifest(tmp_path)
    assert [e["version"] for e in manifest["entries"] if e["full"]] == [10, 20]  # anchor 0 pruned
    assert not (tmp_path / f"v{0:010d}.full").exists()
    late = DirectorySubscriber(tmp_path, _blank(states))
    assert late.poll() == 25 and _same(late.receiver.state, states[25])
    replayed = [f"v{20:010d}.full", *(f"v{v:010d}.f0.patch" for v in range(21, 26))]
    assert late.bytes_read == sum((tmp_path / name).stat().st_size for name in replayed)
    for sub in (follower, joiner_14):
        assert sub.poll() == 25 and _same(sub.receiver.state, states[25]) and sub.fallbacks == 0


def test_corrupt_patch_falls_back_to_full_sync(tmp_path, caplog):
    states = _versions(14)
    pub = DirectoryPublisher(tmp_path, DirectoryConfig(anchor_every=4))  # anchors 0, 4, 8, 12
    sub = DirectorySubscriber(tmp_path, _blank(states))
    for v in range(12):
        _publish(pub, states, v)
    assert sub.poll() == 11
    _publish(pub, states, 12)
    _publish(pub, states, 13)
    damaged = tmp_path / f"v{12:010d}.f0.patch"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert sub.poll() == 13
    assert _same(sub.receiver.state, states[13]) and sub.fallbacks == 1
    assert "falling back to a full sync" in caplog.text


def test_first_version_needs_an_anchor(tmp_path):
    import pytest

    pub = DirectoryPublisher(tmp_path)
    with pytest.raises(ValueError, match="needs a full anchor"):
        pub.publish(version=0, base_version=None, parts=[], full=None)
