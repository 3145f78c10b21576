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
from sparserl_mcore.sync.codec import STREAMS, CodecConfig, PatchError, encode_patch
from sparserl_mcore.sync.diff import full_patch, make_patch

PREFIX = struct.Struct("<8sHBBIIQQ")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (torch.randn(96, 400, generator=gen) * 0.02).bfloat16(),
        "b.weight": (torch.randn(20000, generator=gen) * 0.02).bfloat16(),
        "c.bias": torch.zeros(40, dtype=torch.bfloat16),
    }


def _stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        # half a BF16 ulp of |w| < ~0.001 is < 3e-6: only small weights flip (positions use magnitude classes)
        k: (v.float() + 3e-6 * torch.randn(v.shape, generator=gen).sign()).bfloat16()
        for k, v in state.items()
    }


def _split(data: bytes) -> tuple[tuple, dict, bytes]:
    """(prefix fields, header, stored body: one zstd frame per stream)."""
    fields = PREFIX.unpack_from(data)
    header_len = fields[4]
    header = json.loads(zstandard.ZstdDecompressor().decompress(data[PREFIX.size : PREFIX.size + header_len]))
    return fields, header, data[PREFIX.size + header_len : -16]


def _seal(fields: tuple, header: dict, streams: list[bytes], compress: bool = True) -> bytes:
    """Re-frame raw streams with a valid checksum and a consistent stream table, as a buggy (not a
    noisy) sender would: only the content is wrong."""
    zstd = zstandard.ZstdCompressor(level=1)
    stored = [zstd.compress(x) if compress and x else x for x in streams]
    header = {
        **header,
        "streams": {k: [len(r), len(st)] for k, r, st in zip(STREAMS, streams, stored, strict=True)},
    }
    raw_head = json.dumps(header).encode()
    head = zstd.compress(raw_head) if compress else raw_head
    body = b"".join(stored)
    raw_len = sum(len(x) for x in streams)
    prefix = PREFIX.pack(
        fields[0], fields[1], 1 if compress else 0, 0, len(head), len(raw_head), len(body), raw_len
    )
    return prefix + head + body + xxhash.xxh3_128_digest(prefix + head + body)


@pytest.fixture(scope="module")
def setup():
    base = _state(0)
    new = _stepped(base, 1)
    data = encode_patch(make_patch(base, new, version=4, base_version=3, anchor_version=0), CodecConfig())
    assert all(t["cuts"] for t in _split(data)[1]["tensors"] if t["name"] != "c.bias")  # base model in use
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


def _raw_streams(data: bytes) -> list[bytes]:
    _, header, body = _split(data)
    out, offset = [], 0
    for key in STREAMS:
        raw_len, stored = header["streams"][key]
        out.append(zstandard.ZstdDecompressor().decompress(body[offset : offset + stored]) if stored else b"")
        offset += stored
    return out


def test_resealed_semantic_damage_is_rejected(setup):
    base, _, data = setup
    fields, header, _ = _split(data)
    gaps, escapes, lo, hi = streams = _raw_streams(data)
    variants = []

    def with_header(edit) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        variants.append(_seal(fields, h, streams))

    first = header["tensors"][0]
    with_header(lambda h: h["tensors"].append(dict(h["tensors"][0])))  # duplicated tensor entry
    with_header(lambda h: h["tensors"][0].update(name="zzz.weight"))  # unknown tensor
    with_header(lambda h: h["tensors"][0].update(shape=[400, 96]))  # wrong shape
    with_header(lambda h: h["tensors"][0].update(dtype="float32"))
    with_header(lambda h: h["tensors"][0].update(nnz=first["nnz"] + 1))
    with_header(lambda h: h["tensors"][0].update(digest="00" * 16))  # wrong reconstructed digest
    with_header(lambda h: h.update(model_digest="11" * 16))
    with_header(lambda h: h.update(base_version=2))
    with_header(lambda h: h.update(base_version=None))  # sparse content claimed full
    with_header(lambda h: h.update(encoding="lz77"))
    with_header(lambda h: h["tensors"].reverse())  # tensor sections reordered
    with_header(lambda h: h.pop("tensors"))
    with_header(lambda h: h["tensors"][0]["runs"][0].__setitem__(1, 2))  # gap planes misread
    with_header(lambda h: h["tensors"][0]["runs"][0].__setitem__(1, 0))
    with_header(lambda h: h["tensors"][0]["runs"].reverse())  # class runs swapped
    with_header(lambda h: h["tensors"][0].update(runs=h["tensors"][0]["runs"][:1]))
    # class layout: a cut moved (sizes no longer those of the base), sizes shifted between classes,
    # a cut dropped, cuts not ascending, a cut past the finite magnitudes
    cuts, sizes = first["cuts"], first["class_sizes"]
    assert len(cuts) >= 2
    with_header(lambda h: h["tensors"][0].update(cuts=[*cuts[:-1], cuts[-1] + 128]))
    with_header(lambda h: h["tensors"][0].update(class_sizes=[sizes[0] + 1, sizes[1] - 1, *sizes[2:]]))
    with_header(lambda h: h["tensors"][0].update(cuts=cuts[:-1], class_sizes=sizes[:-1]))
    with_header(lambda h: h["tensors"][0].update(cuts=cuts[::-1]))
    with_header(lambda h: h["tensors"][0].update(cuts=[0x7F81]))
    # gap stream bytes driven out of range: the first class's ranks pushed past its size
    nnz0 = first["runs"][0][0]
    variants.append(_seal(fields, header, [b"\xfe" * nnz0 + gaps[nnz0:], escapes, lo, hi]))
    variants.append(_seal(fields, header, [gaps, escapes, hi, lo]))  # value planes swapped
    variants.append(_seal(fields, header, [gaps, escapes, lo, hi[:-1]]))  # a value plane short
    variants.append(_seal(fields, header, [gaps[1:], escapes, lo, hi]))  # gap stream short
    variants.append(_seal(fields, header, streams, compress=False)[:-17] + b"\0" * 17)
    failures = [k for k, v in enumerate(variants) if not _rejected(base, v)]
    assert failures == []


def test_a_wrong_or_corrupt_base_is_rejected(setup):
    """Positions decode against the receiver's base: a base whose magnitude classes differ is
    rejected before any write; one that differs inside a class is caught by the digests."""
    base, _, data = setup
    header = _split(data)[1]
    cut = header["tensors"][0]["cuts"][0]
    flat = base["a.weight"].view(-1).view(torch.int16)
    mags = flat.int() & 0x7FFF
    small, large = int(torch.nonzero(mags < cut)[0]), int(torch.nonzero(mags >= cut)[0])
    crossed = {k: v.clone() for k, v in base.items()}
    crossed["a.weight"].view(-1).view(torch.int16)[small] = flat[large]  # a small weight became large
    same_class = {k: v.clone() for k, v in base.items()}
    same_class["a.weight"].view(-1).view(torch.int16)[large] ^= 1  # one ulp, same class
    other_seed = _state(5)  # same names and shapes, different values
    for wrong in (crossed, same_class, other_seed):
        assert _rejected(wrong, data)
    receiver = HFReceiver({k: v.clone() for k, v in crossed.items()}, version=3)
    with pytest.raises(PatchError, match="do not match the patch's position classes"):
        receiver.apply(data)


def test_full_patch_for_a_different_model_is_rejected():
    base = _state(0)
    other = {k: v for k, v in _state(1).items() if k != "c.bias"}
    assert _rejected(base, encode_patch(full_patch(other, version=9)))
