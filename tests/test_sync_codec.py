"""Codec, diff and apply: round trips for every value encoding, validation, all-or-nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sparserl_mcore.sync import positions
from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import (
    POSITION_MODELS,
    VALUE_ENCODINGS,
    CodecConfig,
    PatchError,
    decode_patch,
    encode_patch,
    inspect_patch,
    read_header,
    resolve_positions,
)
from sparserl_mcore.sync.diff import full_patch, make_patch
from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _adam_like_step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """fp32 master += lr * sign noise, cast back to bf16: the RL-regime update pattern."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        master = t.float()
        if name != "norm.weight":
            master -= lr * torch.randn(t.shape, generator=gen).sign()
        out[name] = master.to(t.dtype)
    return out


@pytest.fixture()
def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": (torch.randn(300, 64, generator=gen) * 0.02).bfloat16(),
        "layer.0.weight": (torch.randn(64, 64, generator=gen) * 0.02).bfloat16(),
        "layer.0.bias": torch.zeros(64, dtype=torch.bfloat16),
        "norm.weight": torch.ones(64, dtype=torch.bfloat16),
        # a sign crossing, -0/+0 and NaN patterns must all survive bit-exactly
        "odd.weight": torch.tensor([0.0, -0.0, float("nan"), 1e-30, -1e-30, 3.0], dtype=torch.bfloat16),
    }
    return state


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.mark.parametrize("position_model", POSITION_MODELS)
@pytest.mark.parametrize("encoding", sorted(VALUE_ENCODINGS))
@pytest.mark.parametrize("zstd_level", [None, 1, 9])
def test_round_trip_bit_exact(weights, encoding, zstd_level, position_model):
    new = _adam_like_step(weights, 3e-6, seed=1)
    new["odd.weight"] = torch.tensor([-0.0, 0.0, 1.0, -1e-30, 1e-30, float("nan")], dtype=torch.bfloat16)
    patch = make_patch(weights, new, version=7, base_version=6, anchor_version=0)
    config = CodecConfig(encoding=encoding, zstd_level=zstd_level, position_model=position_model)
    data = encode_patch(patch, config)
    base_coded = [t["name"] for t in read_header(data)[1]["tensors"] if t["cuts"]]
    # overwrite needs no base values, so it keeps plain positions
    assert bool(base_coded) == (position_model == "base" and encoding != "overwrite")
    receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=6)
    result = receiver.apply(data)
    assert _equal(receiver.state, new)
    assert result.version == receiver.version == 7
    assert result.changed_elements == sum(int((_bits(weights[k]) != _bits(new[k])).sum()) for k in new)
    assert receiver.model_digest() == patch.model_digest


@pytest.mark.parametrize(
    ("indices", "gap_width"),
    [
        # half the gaps exceed a byte: two-byte gaps, themselves escaping past 65534
        ([0, 1, 254, 255, 511, 70_000, 200_000, 209_999], 2),
        # one long gap among many short ones: one-byte gaps with a single escape
        ([*range(0, 300, 3), 1000, *range(1001, 1200, 2), 209_999], 1),
    ],
)
@pytest.mark.parametrize("zstd_level", [None, 1])
def test_large_gaps_use_escapes(indices, gap_width, zstd_level):
    big = {"w": torch.zeros(70_000, 3, dtype=torch.bfloat16)}
    new = {"w": big["w"].clone()}
    new["w"].view(-1)[indices] = 1.0
    patch = make_patch(big, new, version=1, base_version=0, anchor_version=0)
    data = encode_patch(patch, CodecConfig(zstd_level=zstd_level))
    entry = read_header(data)[1]["tensors"][0]
    assert entry["cuts"] == [] and entry["runs"][0][1] == gap_width  # all-zero base: one class
    np.testing.assert_array_equal(decode_patch(data).tensors[0].indices, indices)


def test_full_patch_restores_any_state(weights):
    receiver = HFReceiver({k: torch.zeros_like(v) for k, v in weights.items()}, version=3)
    receiver.apply(encode_patch(full_patch(weights, version=10)))
    assert _equal(receiver.state, weights) and receiver.version == 10


def test_delta_encodings_need_the_named_base(weights):
    new = _adam_like_step(weights, 1e-3, seed=2)
    data = encode_patch(make_patch(weights, new, version=2, base_version=1, anchor_version=0))
    receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=0)
    with pytest.raises(PatchError, match="based on version 1, the receiver holds 0"):
        receiver.apply(data)
    assert _equal(receiver.state, weights)


def test_unknown_tensor_and_shape_mismatch_rejected(weights):
    new = _adam_like_step(weights, 1e-3, seed=3)
    data = encode_patch(make_patch(weights, new, version=1, base_version=0, anchor_version=0))
    renamed = {("other." + k if k == "layer.0.weight" else k): v.clone() for k, v in weights.items()}
    with pytest.raises(PatchError, match="unknown to the receiver"):
        HFReceiver(renamed, version=0).apply(data)
    reshaped = {
        k: (v.clone().reshape(64, 300) if k == "embed.weight" else v.clone()) for k, v in weights.items()
    }
    with pytest.raises(PatchError, match="embed.weight"):
        HFReceiver(reshaped, version=0).apply(data)


def test_digest_mismatch_rolls_back(weights):
    new = _adam_like_step(weights, 1e-3, seed=4)
    patch = make_patch(weights, new, version=1, base_version=0, anchor_version=0)
    # A patch whose last tensor claims a wrong digest: earlier tensors are written, then undone.
    forged = dataclasses.replace(patch.tensors[-1], digest=bytes(16))
    patch = dataclasses.replace(patch, tensors=(*patch.tensors[:-1], forged))
    receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=0)
    with pytest.raises(PatchError, match="digest mismatch"):
        receiver.apply(encode_patch(patch))
    assert _equal(receiver.state, weights) and receiver.version == 0


def test_inspect_reports_sparsity_and_bytes(weights):
    new = _adam_like_step(weights, 1e-4, seed=5)
    data = encode_patch(make_patch(weights, new, version=5, base_version=4, anchor_version=0))
    info = inspect_patch(data)
    changed = sum(int((_bits(weights[k]) != _bits(new[k])).sum()) for k in new)
    numel = sum(v.numel() for v in weights.values())
    assert info["changed_elements"] == changed and info["bytes"] == len(data)
    assert info["sparsity"] == pytest.approx(1 - changed / numel)
    assert (info["version"], info["base_version"], info["encoding"]) == (5, 4, "sub")
    assert {t["name"] for t in info["tensors"]} <= set(weights)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="encoding='delta' is unknown; choose from overwrite, xor, sub"):
        CodecConfig(encoding="delta")
    with pytest.raises(ValueError, match="zstd_level=0"):
        CodecConfig(zstd_level=0)
    with pytest.raises(ValueError, match="position_model='exponent' is unknown; choose from base, plain"):
        CodecConfig(position_model="exponent")


def test_base_model_codes_flipping_classes_in_few_bytes():
    """Small weights flip, large ones do not: with the base model the positions cost ~nothing,
    the decoded indices are the changed ones, and the plain model pays ~a byte per change."""
    gen = torch.Generator().manual_seed(3)
    old = {"w": (torch.randn(400, 500, generator=gen) * 0.02).bfloat16()}
    new = {"w": (old["w"].float() + 1e-6).bfloat16()}  # flips iff half an ulp of |w| < 1e-6
    changed = np.flatnonzero((_bits(old["w"]) != _bits(new["w"])).numpy())
    assert 0.005 < changed.size / old["w"].numel() < 0.05
    patch = make_patch(old, new, version=1, base_version=0, anchor_version=0)
    sizes = {m: len(encode_patch(patch, CodecConfig(position_model=m))) for m in POSITION_MODELS}
    assert sizes["base"] < 0.75 * sizes["plain"]
    data = encode_patch(patch, CodecConfig())
    decoded = decode_patch(data).tensors[0]
    assert decoded.indices is None and decoded.classes is not None  # needs the base to resolve
    resolved = resolve_positions(decode_patch(data), lambda name: _bits(old[name]).numpy().view(np.uint16))
    np.testing.assert_array_equal(resolved.tensors[0].indices, changed)
    receiver = HFReceiver({"w": old["w"].clone()}, version=0)
    receiver.apply(data)
    assert _equal(receiver.state, new)


def test_fragments_apply_together_only(weights):
    new = _adam_like_step(weights, 1e-3, seed=6)
    patch = make_patch(weights, new, version=1, base_version=0, anchor_version=0)
    half = len(patch.tensors) // 2
    parts = [
        encode_patch(dataclasses.replace(patch, tensors=patch.tensors[:half], fragment=(0, 2))),
        encode_patch(dataclasses.replace(patch, tensors=patch.tensors[half:], fragment=(1, 2))),
    ]
    for bad in ([parts[0]], parts[1], parts[0] + parts[0] + parts[1], parts[0] + parts[1][:-1]):
        receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=0)
        with pytest.raises(PatchError):
            receiver.apply(bad)
        assert _equal(receiver.state, weights)
    for good in (parts, parts[1] + parts[0]):  # a list, or one concatenated blob in any order
        receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=0)
        receiver.apply(good)
        assert _equal(receiver.state, new)
    assert inspect_patch(b"".join(parts))["fragments"] == 2


def test_per_rank_fragments_report_every_tensor_they_wrote(weights):
    """Per-rank fragments of disjoint tensors (PP stages) applied in one call: the result names
    every tensor written, not only the last fragment's (an engine refreshes exactly those)."""
    new = _adam_like_step(weights, 1e-3, seed=7)
    meta = ModelMeta(dtype="bfloat16", shapes={n: tuple(t.shape) for n, t in weights.items()})
    stages = [["embed.weight", "layer.0.weight"], ["layer.0.bias", "norm.weight", "odd.weight"]]
    fragments = []
    for rank, names in enumerate(stages):
        changes = []
        for name in names:
            old_bits, new_bits = _bits(weights[name]).view(-1).numpy(), _bits(new[name]).view(-1).numpy()
            idx = np.flatnonzero(old_bits != new_bits)
            changes.append((name, idx, old_bits[idx].view(np.uint16), new_bits[idx].view(np.uint16)))
        fragments.append(
            encode_fragment(changes, meta, version=1, base_version=0, fragment=(rank, len(stages)))
        )
    receiver = HFReceiver({k: v.clone() for k, v in weights.items()}, version=0)
    result = receiver.apply(fragments)
    assert _equal(receiver.state, new) and receiver.version == 1
    changed = {n for n in weights if not torch.equal(_bits(weights[n]), _bits(new[n]))}
    assert set(result.touched) == set(weights)  # every tensor of both fragments
    assert result.changed_elements == sum(int((_bits(weights[n]) != _bits(new[n])).sum()) for n in changed)


def test_class_ranks_read_only_unchanged_positions_of_base_bits():
    """The learner passes its already-updated mirror as base_bits: changed elements that crossed a
    cut (both ways) must still be classed by their old values, so the result equals the old tensor's."""
    gen = torch.Generator().manual_seed(4)
    old = _bits((torch.randn(5000, generator=gen) * 0.02).bfloat16()).numpy().view(np.uint16).copy()
    cuts = (0x3900, 0x3A00)  # |w| < 2^-13, < 2^-11 (bf16 exponent boundaries)
    new = old.copy()
    changed = np.sort(np.random.default_rng(0).choice(old.size, 400, replace=False))
    new[changed[::2]] = (old[changed[::2]] & 0x8000) | 0x3880  # now below both cuts
    new[changed[1::2]] = (old[changed[1::2]] & 0x8000) | 0x3C00  # now above both
    changed = changed[new[changed] != old[changed]]
    mags = old[changed] & 0x7FFF
    assert ((mags < 0x3A00) & ((new[changed] & 0x7FFF) >= 0x3A00)).any()  # crossings both ways
    assert ((mags >= 0x3A00) & ((new[changed] & 0x7FFF) < 0x3A00)).any()
    from_old = positions.class_ranks(changed, old[changed], new[changed], old, cuts)
    from_new = positions.class_ranks(changed, old[changed], new[changed], new, cuts)
    assert from_old[2] == from_new[2]
    np.testing.assert_array_equal(from_old[1], from_new[1])
    for a, b in zip(from_old[0], from_new[0], strict=True):
        np.testing.assert_array_equal(a, b)
    # and the receiver, holding the old tensor, maps them back to the changed positions
    flat = positions.class_positions(old, cuts, from_old[2], from_old[0])
    np.testing.assert_array_equal(np.sort(flat), changed)
    np.testing.assert_array_equal(flat, changed[from_old[1]])


@pytest.mark.parametrize("threads", [1, 2])
def test_class_ranks_match_a_direct_count_over_threaded_chunks(threads):
    """Ranks, class sizes and decoded positions equal a direct count over the whole tensor, with the
    pass split over chunks and threads (9M elements: >= 16 chunks per thread, a ragged tail)."""
    gen = torch.Generator().manual_seed(5)
    old = _bits((torch.randn(9_000_001, generator=gen) * 0.02).bfloat16()).numpy().view(np.uint16).copy()
    cuts = (0x3700, 0x3800, 0x3880)
    rng = np.random.default_rng(1)
    small = np.flatnonzero((old & 0x7FFF) < cuts[-1])  # small weights flip more often
    changed = np.union1d(rng.choice(old.size, 30_000, replace=False), rng.choice(small, 3_000, replace=False))
    new = old.copy()
    new[changed] = old[changed] ^ 1  # lowest mantissa bit: never crosses a cut
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ranks, order, sizes = positions.class_ranks(changed, old[changed], new[changed], new, cuts)
        flat = positions.class_positions(old, cuts, sizes, ranks)
    finally:
        torch.set_num_threads(before)
    every_class = np.searchsorted(np.array(cuts), old & 0x7FFF, side="right")
    assert sizes == np.bincount(every_class, minlength=4).tolist()
    for c in range(3):
        members = np.flatnonzero(every_class == c)
        mine = changed[every_class[changed] == c]
        np.testing.assert_array_equal(ranks[c], np.searchsorted(members, mine))
        assert ranks[c].size > 100  # every lower class has changes to rank
    np.testing.assert_array_equal(ranks[3], changed[every_class[changed] == 3])
    np.testing.assert_array_equal(flat, changed[order])
