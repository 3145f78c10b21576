"""Corruption fuzz: every mutated patch is rejected with PatchError and the receiver is unchanged.

Two families: raw byte damage (caught by framing + trailing checksum) and re-sealed semantic damage
(valid checksum, broken content: the decoder's own checks must catch it).
"""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
import xxhash
import zstandard

from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import CodecConfig, PatchError, encode_patch
from sparserl_mcore.sync.diff import full_patch, make_patch

PREFIX = struct.Struct("<8sHBBIIQQ")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (torch.randn(96, 40, generator=gen) * 0.02).bfloat16(),
        "b.weight": (torch.randn(2000, generator=gen) * 0.02).bfloat16(),
        "c.bias": torch.zeros(40, dtype=torch.bfloat16),
    }


def _stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + 3e-4 * torch.randn(v.shape, generator=gen).sign()).bfloat16()
        for k, v in state.items()
    }


def _split(data: bytes) -> tuple[tuple, dict, bytes]:
    fields = PREFIX.unpack_from(data)
    header_len = fields[4]
    header = json.loads(zstandard.ZstdDecompressor().decompress(data[PREFIX.size : PREFIX.size + header_len]))
    return fields, header, data[PREFIX.size + header_len : -16]


def _seal(fields: tuple, header: dict, raw: bytes, compress: bool = True) -> bytes:
    """Re-frame with a valid checksum, as a buggy (not a noisy) sender would."""
    raw_head = json.dumps(header).encode()
    zstd = zstandard.ZstdCompressor(level=1)
    body, head = (zstd.compress(raw), zstd.compress(raw_head)) if compress else (raw, raw_head)
    prefix = PREFIX.pack(
        fields[0], fields[1], 1 if compress else 0, 0, len(head), len(raw_head), len(body), len(raw)
    )
    return prefix + head + body + xxhash.xxh3_128_digest(prefix + head + body)


@pytest.fixture(scope="module")
def setup():
    base = _state(0)
    new = _stepped(base, 1)
    data = encode_patch(make_patch(base, new, version=4, base_version=3, anchor_version=0), CodecConfig())
    return base, new, data


def _rejected(base: dict[str, torch.Tensor], data: bytes, version: int = 3) -> bool:
    receiver = HFReceiver({k: v.clone() for k, v in base.items()}, version=version)
    try:
        receiver.apply(data)
    except PatchError:
        unchanged = all(
            torch.equal(receiver.state[k].view(torch.int16), base[k].view(torch.int16)) for k in base
        )
        return unchanged and receiver.version == version
    return False


def test_the_unmutated_patch_applies(setup):
    base, new, data = setup
    receiver = HFReceiver({k: v.clone() for k, v in base.items()}, version=3)
    receiver.apply(data)
    assert all(torch.equal(receiver.state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)


def test_byte_level_damage_is_rejected(setup):
    base, _, data = setup
    rng = random.Random(1234)
    mutants = []
    for _ in range(150):  # single and multiple bit flips anywhere
        buf = bytearray(data)
        for _ in range(rng.choice([1, 1, 2, 5])):
            pos = rng.randrange(len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
        mutants.append(bytes(buf))
    for _ in range(60):  # truncation
        mutants.append(data[: rng.randrange(len(data))])
    for _ in range(40):  # duplicated span
        i = rng.randrange(len(data))
        j = min(len(data), i + rng.randrange(1, 64))
        mutants.append(data[:j] + data[i:j] + data[j:])
    for _ in range(40):  # two spans swapped
        i, j = sorted(rng.sample(range(len(data)), 2))
        n = rng.randrange(1, max(2, min(64, j - i)))
        if i + n <= j:
            mutants.append(data[:i] + data[j : j + n] + data[i + n : j] + data[i : i + n] + data[j + n :])
    mutants.append(data + data)
    mutants.append(b"")
    assert len(mutants) >= 250
    failures = [k for k, m in enumerate(mutants) if m != data and not _rejected(base, m)]
    assert failures == []


def test_wrong_base_and_wrong_model_are_rejected(setup):
    base, _, data = setup
    for version in (None, 0, 2, 4, 100):
        assert _rejected(base, data, version=version)
    other = _state(7)
    other["d.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    assert _rejected(other, data)


def _raw(data: bytes) -> bytes:
    _, _, body = _split(data)
    return zstandard.ZstdDecompressor().decompress(body)


def test_resealed_semantic_damage_is_rejected(setup):
    base, _, data = setup
    fields, header, _ = _split(data)
    raw = _raw(data)
    streams = header["streams"]
    n_gaps = streams["gaps"]
    variants = []

    def with_header(edit) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        variants.append(_seal(fields, h, raw))

    with_header(lambda h: h["tensors"].append(dict(h["tensors"][0])))  # duplicated tensor entry
    with_header(lambda h: h["tensors"][0].update(name="zzz.weight"))  # unknown tensor
    with_header(lambda h: h["tensors"][0].update(shape=[40, 96]))  # wrong shape
    with_header(lambda h: h["tensors"][0].update(dtype="float32"))
    with_header(lambda h: h["tensors"][0].update(nnz=h["tensors"][0]["nnz"] + 1))
    with_header(lambda h: h["tensors"][0].update(digest="00" * 16))  # wrong reconstructed digest
    with_header(lambda h: h.update(model_digest="11" * 16))
    with_header(lambda h: h.update(base_version=2))
    with_header(lambda h: h.update(base_version=None))  # sparse content claimed full
    with_header(lambda h: h.update(encoding="lz77"))
    with_header(lambda h: h["tensors"].reverse())  # tensor sections reordered
    with_header(lambda h: h["streams"].update(gaps=n_gaps - 1, escapes=streams["escapes"] + 1))
    with_header(lambda h: h.pop("tensors"))
    with_header(lambda h: h["tensors"][0].update(gap_width=2))  # gap planes misread
    with_header(lambda h: h["tensors"][0].update(gap_width=0))
    # gap stream bytes driven out of range: last gap pushed past the tensor end
    out_of_range = bytearray(raw)
    out_of_range[header["tensors"][0]["nnz"] - 1] = 254
    for k in range(header["tensors"][0]["nnz"]):
        out_of_range[k] = 254
    variants.append(_seal(fields, header, bytes(out_of_range)))
    # value planes swapped
    lo, hi = n_gaps + streams["escapes"], n_gaps + streams["escapes"] + streams["values_lo"]
    variants.append(_seal(fields, header, raw[:lo] + raw[hi:] + raw[lo:hi]))
    variants.append(_seal(fields, header, raw[:-1]))  # body shorter than its streams
    variants.append(_seal(fields, header, raw, compress=False)[:-17] + b"\0" * 17)
    failures = [k for k, v in enumerate(variants) if not _rejected(base, v)]
    assert failures == []


def test_full_patch_for_a_different_model_is_rejected():
    base = _state(0)
    other = {k: v for k, v in _state(1).items() if k != "c.bias"}
    assert _rejected(base, encode_patch(full_patch(other, version=9)))
