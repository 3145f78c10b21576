"""ShardedReceiver (pure, single process): HF-coordinate patches into Megatron TP/PP shards.

The expected shard contents come from `layout.fill_local` of the new HF weights (the whole-shard
path), an independent route from the per-element `to_local_index` the receiver uses.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.sync.codec import CodecConfig, PatchError, encode_patch, read_header
from sparserl_mcore.sync.diff import full_patch, make_patch
from sparserl_mcore.sync.sharded import ShardedReceiver

HF = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # padding rows in every layout; embeddings big enough for base-coded positions to pay off
    "vocab_size": 997,
}
PAD = 1024


def _hf_states(tie: bool, step: float = 2e-4) -> tuple[ModelLayout, dict, dict]:
    """Old and new HF weights; at a small `step` only small weights flip (base-coded positions)."""
    cfg = parse_hf_config({**HF, "tie_word_embeddings": tie})
    shapes = ModelLayout(cfg, tp_size=1, pp_size=1, padded_vocab_size=PAD).hf_shapes
    gen = torch.Generator().manual_seed(0)
    old = {n: (torch.randn(s, generator=gen) * 0.05).bfloat16() for n, s in shapes.items()}
    new = {}
    for n, t in old.items():
        master = t.float() + step * torch.randn(t.shape, generator=gen).sign()
        new[n] = master.bfloat16()
    return cfg, old, new


def _shards(layout: ModelLayout, hf: dict, held) -> dict:
    def read(name, rows, cols):
        return hf[name][rows] if cols is None else hf[name][rows, cols]

    out = {}
    for tp, pp in held:
        params = {}
        for name, pmap in layout.shard(tp, pp).items():
            params[name] = torch.empty(pmap.shape, dtype=torch.bfloat16)
            layout.fill_local(pmap, params[name], read)
        out[tp, pp] = params
    return out


def _bits_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize(
    ("tp", "pp", "tie", "encoding"), [(2, 1, False, "sub"), (2, 2, True, "xor"), (1, 2, True, "overwrite")]
)
def test_patch_reaches_every_copy_and_verifies(tp, pp, tie, encoding):
    cfg, old, new = _hf_states(tie, step=5e-6)
    layout = ModelLayout(cfg, tp_size=tp, pp_size=pp, padded_vocab_size=PAD * tp)
    all_shards = list(itertools.product(range(tp), range(pp)))
    receiver = ShardedReceiver(layout, _shards(layout, old, all_shards), version=0)
    assert receiver.covered == set(layout.hf_shapes)
    data = encode_patch(
        make_patch(old, new, version=1, base_version=0, anchor_version=0), CodecConfig(encoding=encoding)
    )
    # delta encodings code positions against the base (rebuilt from the shards), overwrite does not
    assert any(t["cuts"] for t in read_header(data)[1]["tensors"]) == (encoding != "overwrite")
    receiver.apply(data)
    expected = _shards(layout, new, all_shards)  # replicas, tied copy and zero padding rows included
    for shard in all_shards:
        assert _bits_equal(receiver.shards[shard], expected[shard])
    assert receiver.version == 1


def test_partial_receiver_applies_its_part_without_digest_check():
    cfg, old, new = _hf_states(tie=False, step=5e-6)
    layout = ModelLayout(cfg, tp_size=2, pp_size=1, padded_vocab_size=2 * PAD)
    receiver = ShardedReceiver(layout, _shards(layout, old, [(1, 0)]), version=0)
    assert receiver.covered == set()  # every tensor has a part on tp_rank 0 (norms are emitted there)
    patch = make_patch(old, new, version=1, base_version=0, anchor_version=0)
    assert any(t["cuts"] for t in read_header(encode_patch(patch))[1]["tensors"])
    before = {n: t.clone() for n, t in receiver.shards[1, 0].items()}
    # positions coded against whole base tensors cannot be decoded from a part: rejected, untouched
    with pytest.raises(PatchError, match="holds only part of it"):
        receiver.apply(encode_patch(patch))
    assert _bits_equal(receiver.shards[1, 0], before) and receiver.version == 0
    receiver.apply(encode_patch(patch, CodecConfig(position_model="plain")))
    assert _bits_equal(receiver.shards[1, 0], _shards(layout, new, [(1, 0)])[1, 0])


def test_bad_patches_leave_the_shards_unchanged():
    cfg, old, new = _hf_states(tie=True)
    layout = ModelLayout(cfg, tp_size=2, pp_size=1, padded_vocab_size=2 * PAD)
    receiver = ShardedReceiver(layout, _shards(layout, old, [(0, 0), (1, 0)]), version=0)
    before = {s: {n: t.clone() for n, t in p.items()} for s, p in receiver.shards.items()}
    wrong_base = encode_patch(make_patch(old, new, version=3, base_version=2, anchor_version=0))
    # a full patch whose norm values no longer match its digest: written, verified, rolled back
    forged = full_patch(new, version=5)
    flipped = tuple(
        dataclasses.replace(t, new_bits=t.new_bits ^ 1) if t.name == "model.norm.weight" else t
        for t in forged.tensors
    )
    bad_digest = encode_patch(dataclasses.replace(forged, tensors=flipped))
    for data in (wrong_base, bad_digest, wrong_base[:-3]):
        with pytest.raises(PatchError):
            receiver.apply(data)
        for shard, params in receiver.shards.items():
            assert _bits_equal(params, before[shard])
        assert receiver.version == 0
