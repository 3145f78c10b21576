"""Pure-tensor checks of the Megatron <-> HF layout: whole-shard build against an independent
reference, export coverage, and the per-element maps against the whole-shard path."""

from __future__ import annotations

import pytest
import torch

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.ckpt.layout import ModelLayout

CASES = [
    # arch, tie, tp, pp, layers, ep
    ("qwen2", False, 1, 1, 2, 1),
    ("qwen2", True, 2, 2, 2, 1),
    ("qwen3", False, 2, 1, 2, 1),
    ("qwen3", True, 1, 2, 2, 1),
    ("llama", False, 2, 2, 2, 1),
    ("llama", True, 2, 1, 2, 1),
    # uneven pipeline stages: 5 layers split (3, 2) and (2, 2, 1)
    ("qwen2", True, 2, 2, 5, 1),
    ("llama", False, 1, 3, 5, 1),
    ("qwen3", True, 2, 3, 5, 1),
    # mixtures of experts (4 experts): EP alone, TP x EP, with PP and a shared expert
    ("qwen3_moe", False, 1, 1, 2, 2),
    ("qwen3_moe", True, 2, 2, 2, 2),
    ("qwen2_moe", False, 2, 1, 2, 4),
    ("qwen2_moe", True, 1, 2, 5, 2),
]
EXPERTS, EXPERT_FFN, SHARED_FFN = 4, 6, 8


def _hf_config(arch: str, tie: bool, layers: int = 2) -> dict:
    config = {
        "model_type": arch,
        "num_hidden_layers": layers,
        "hidden_size": 12,
        "intermediate_size": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 3,
        "vocab_size": 23,  # not a multiple of anything: exercises the padding rows
        "tie_word_embeddings": tie,
    }
    if arch.endswith("_moe"):
        config.update(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=EXPERT_FFN)
        config.update(shared_expert_intermediate_size=SHARED_FFN)
    return config


def _setup(arch: str, tie: bool, tp: int, pp: int, layers: int = 2, ep: int = 1, etp: int | None = None):
    """Layout, random HF tensors and every shard's local tensors (keyed as `layout.shard_keys()`)."""
    hf_cfg = parse_hf_config(_hf_config(arch, tie, layers))
    layout = ModelLayout(hf_cfg, tp_size=tp, pp_size=pp, padded_vocab_size=32, ep_size=ep, etp_size=etp)
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in layout.hf_shapes.items()}
    shards = {}
    for key in layout.shard_keys():
        local = {}
        for name, param in layout.shard(*key).items():
            out = torch.full(param.shape, float("nan"))
            layout.fill_local(
                param, out, lambda n, rows, cols: hf[n][rows] if cols is None else hf[n][rows, cols]
            )
            local[name] = out
        shards[key] = local
    return hf_cfg, layout, hf, shards


def _swiglu(hf: dict, a: str, size: int, rank: int) -> dict[str, torch.Tensor]:
    gate = hf[a + "gate_proj.weight"].chunk(size, dim=0)[rank]
    up = hf[a + "up_proj.weight"].chunk(size, dim=0)[rank]
    return {
        "linear_fc1.weight": torch.cat([gate, up]),
        "linear_fc2.weight": hf[a + "down_proj.weight"].chunk(size, dim=1)[rank],
    }


def _reference_mlp(hf_cfg, hf: dict, a: str, tp: int, tp_rank: int, ep: int, ep_rank: int, etp: int):
    """megatron's MLP tensors of one layer: dense, or router + experts ep_rank * E / EP .. (each
    split over expert-TP rank tp_rank % ETP) + the shared expert, written out directly."""
    if hf_cfg.moe is None:
        return {f"mlp.{k}": v for k, v in _swiglu(hf, a + "mlp.", tp, tp_rank).items()}
    out = {"mlp.router.weight": hf[a + "mlp.gate.weight"]}
    local = EXPERTS // ep
    for j in range(local):
        expert = _swiglu(hf, f"{a}mlp.experts.{ep_rank * local + j}.", etp, tp_rank % etp)
        out.update({f"mlp.experts.local_experts.{j}.{k}": v for k, v in expert.items()})
    if hf_cfg.moe.shared_expert_ffn_hidden_size:
        shared = _swiglu(hf, a + "mlp.shared_expert.", tp, tp_rank)
        out.update({f"mlp.shared_experts.{k}": v for k, v in shared.items()})
        out["mlp.shared_experts.gate_weight"] = hf[a + "mlp.shared_expert_gate.weight"]
    return out


def _reference_local(hf_cfg, hf: dict, tp: int, tp_rank: int, layer: int) -> dict[str, torch.Tensor]:
    """Megatron's local attention and norm tensors for one layer written out directly (slime's
    view/split, inverted)."""
    a, d, h = f"model.layers.{layer}.", hf_cfg.head_dim, hf_cfg.hidden_size
    groups, qpg = hf_cfg.num_kv_heads, hf_cfg.num_heads // hf_cfg.num_kv_heads
    q = hf[a + "self_attn.q_proj.weight"].view(groups, qpg * d, h)
    k = hf[a + "self_attn.k_proj.weight"].view(groups, d, h)
    v = hf[a + "self_attn.v_proj.weight"].view(groups, d, h)
    qkv = torch.cat([q, k, v], dim=1).chunk(tp, dim=0)[tp_rank].reshape(-1, h)
    return {
        "self_attention.linear_qkv.weight": qkv,
        "self_attention.linear_proj.weight": hf[a + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank],
        "input_layernorm.weight": hf[a + "input_layernorm.weight"],
        "pre_mlp_layernorm.weight": hf[a + "post_attention_layernorm.weight"],
    }


PARAMS = ("arch", "tie", "tp", "pp", "layers", "ep")


def _stage_layers(layers: int, pp: int) -> list[range]:
    """Global layers of each stage, the default (balanced) split written out by hand."""
    counts = {(2, 1): [2], (2, 2): [1, 1], (5, 2): [3, 2], (5, 3): [2, 2, 1]}[layers, pp]
    starts = [sum(counts[:i]) for i in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def _check_whole_shards(arch, tie, tp, pp, layers, ep, etp=None):
    hf_cfg, layout, hf, shards = _setup(arch, tie, tp, pp, layers, ep, etp)
    for key, local in shards.items():
        tp_rank, pp_rank, ep_rank = (*key, 0)[:3]
        for name, tensor in local.items():
            assert not tensor.isnan().any(), f"{name} not fully written on shard {key}"
        stage = _stage_layers(layers, pp)[pp_rank]
        assert not any(f"decoder.layers.{len(stage)}." in name for name in local), "an extra layer"
        for i, layer in enumerate(stage):
            ref = _reference_local(hf_cfg, hf, tp, tp_rank, layer)
            ref |= _reference_mlp(hf_cfg, hf, f"model.layers.{layer}.", tp, tp_rank, ep, ep_rank, etp or tp)
            mlp = {n for n in local if n.startswith(f"decoder.layers.{i}.mlp.")}
            assert mlp == {f"decoder.layers.{i}.{k}" for k in ref if k.startswith("mlp.")}, "MLP params"
            for suffix, expected in ref.items():
                assert torch.equal(local[f"decoder.layers.{i}.{suffix}"], expected), suffix
        vocab_rows = 32 // tp
        padded = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(32 - 23, 12)])
        if pp_rank == 0:
            embedding = local["embedding.word_embeddings.weight"]
            assert torch.equal(embedding, padded[tp_rank * vocab_rows : (tp_rank + 1) * vocab_rows])
        if pp_rank == pp - 1 and not (tie and pp == 1):
            source = padded if tie else torch.cat([hf["lm_head.weight"], torch.zeros(9, 12)])
            assert torch.equal(
                local["output_layer.weight"], source[tp_rank * vocab_rows : (tp_rank + 1) * vocab_rows]
            )


@pytest.mark.parametrize(PARAMS, CASES)
def test_whole_shard_matches_reference(arch, tie, tp, pp, layers, ep):
    _check_whole_shards(arch, tie, tp, pp, layers, ep)


def test_expert_tensor_parallel_smaller_than_tp_matches_reference():
    """ETP=1 under TP=2: every TP rank holds its EP rank's experts whole (megatron's expert grid)."""
    _check_whole_shards("qwen2_moe", False, 2, 1, 2, 2, etp=1)


def _emitting(layout: ModelLayout, key: tuple[int, ...]) -> dict:
    """The params a shard reports: with EP, shards at ep_rank > 0 hold the same dense weights as
    ep_rank 0 (data-parallel copies, which the sync and the export leave to one data-parallel rank)
    and report only their experts."""
    shard = layout.shard(*key)
    return shard if len(key) < 3 or key[2] == 0 else {n: p for n, p in shard.items() if p.expert}


@pytest.mark.parametrize(PARAMS, CASES)
def test_export_covers_every_hf_element_once(arch, tie, tp, pp, layers, ep):
    _, layout, hf, shards = _setup(arch, tie, tp, pp, layers, ep)
    rebuilt = {n: torch.zeros(s) for n, s in layout.hf_shapes.items()}
    count = {n: torch.zeros(s, dtype=torch.int64) for n, s in layout.hf_shapes.items()}
    for key, local in shards.items():
        for name, param in _emitting(layout, key).items():
            for hf_name, rows, cols, piece in layout.hf_pieces(param, local[name]):
                index = rows if cols is None else (rows, cols)
                rebuilt[hf_name][index] = piece
                count[hf_name][index] += 1
    for name in hf:
        assert torch.equal(count[name], torch.ones_like(count[name])), name
        assert torch.equal(rebuilt[name], hf[name]), name


@pytest.mark.parametrize(PARAMS, CASES)
def test_to_hf_index_agrees_with_whole_shard(arch, tie, tp, pp, layers, ep):
    _, layout, hf, shards = _setup(arch, tie, tp, pp, layers, ep)
    count = {n: torch.zeros(s, dtype=torch.int64).flatten() for n, s in layout.hf_shapes.items()}
    gen = torch.Generator().manual_seed(1)
    for key, local in shards.items():
        for name in _emitting(layout, key):
            tensor = local[name]
            query = torch.randperm(tensor.numel(), generator=gen)  # positions must follow the query order
            for hf_name, pos, hf_flat in layout.to_hf_index(name, query, *key):
                assert torch.equal(hf[hf_name].flatten()[hf_flat], tensor.flatten()[query[pos]]), (
                    name,
                    hf_name,
                )
                count[hf_name].index_add_(0, hf_flat, torch.ones_like(hf_flat))
    for name, c in count.items():
        assert torch.equal(c, torch.ones_like(c)), f"{name}: HF elements not reported exactly once"


@pytest.mark.parametrize(PARAMS, CASES)
def test_to_local_index_agrees_with_whole_shard(arch, tie, tp, pp, layers, ep):
    _, layout, hf, shards = _setup(arch, tie, tp, pp, layers, ep)
    gen = torch.Generator().manual_seed(2)
    for key, local in shards.items():
        hit = {n: torch.zeros(t.numel(), dtype=torch.int64) for n, t in local.items()}
        for hf_name, tensor in hf.items():
            query = torch.randperm(tensor.numel(), generator=gen)
            for name, pos, local_flat in layout.to_local_index(hf_name, query, *key):
                assert torch.equal(local[name].flatten()[local_flat], tensor.flatten()[query[pos]]), (
                    hf_name,
                    name,
                )
                hit[name].index_add_(0, local_flat, torch.ones_like(local_flat))
        for name, h in hit.items():
            param = layout.shard(*key)[name]
            padding = sum(s.rows for s in param.segments if s.hf_name is None) * param.cols
            expected = torch.ones_like(h)
            if padding:
                expected[-padding:] = 0  # padding rows are the last rows of a vocab shard
            assert torch.equal(h, expected), f"{name}: local elements not covered exactly once"


def test_pipeline_offsets_and_tied_copy():
    _, layout, _, _ = _setup("qwen2", True, 1, 2)
    last = layout.shard(0, 1)
    assert "embedding.word_embeddings.weight" not in last
    assert not last["output_layer.weight"].emit
    assert (
        last["decoder.layers.0.input_layernorm.weight"].segments[0].hf_name
        == "model.layers.1.input_layernorm.weight"
    )
    assert layout.to_hf_index("output_layer.weight", torch.arange(5), 0, 1) == []
    ((name, _, _),) = layout.to_local_index("model.embed_tokens.weight", torch.arange(5), 0, 1)
    assert name == "output_layer.weight"


@pytest.mark.parametrize(
    ("change", "tp", "pp", "match"),
    [
        ({"num_key_value_heads": 1}, 2, 1, "num_key_value_heads=1 is not divisible by tp_size=2"),
        ({"num_hidden_layers": 2}, 1, 3, "pp_size=3 is larger than num_hidden_layers=2"),
        ({"intermediate_size": 9}, 2, 1, "intermediate_size=9 is not divisible by tp_size=2"),
    ],
)
def test_impossible_layouts_name_the_numbers(change, tp, pp, match):
    hf_cfg = parse_hf_config({**_hf_config("qwen2", False), **change})
    with pytest.raises(ValueError, match=match):
        ModelLayout(hf_cfg, tp_size=tp, pp_size=pp, padded_vocab_size=32)


@pytest.mark.parametrize(
    ("arch", "tp", "ep", "etp", "match"),
    [
        ("qwen3_moe", 1, 3, None, "num_experts=4 is not divisible by ep_size=3"),
        ("qwen3_moe", 2, 1, 4, "etp_size=4 does not divide tp_size=2"),
        ("qwen2_moe", 4, 1, None, "moe_intermediate_size=6 is not divisible by etp_size=4"),
        ("qwen2", 1, 2, None, "ep_size=2, etp_size=1: qwen2 has no experts"),
    ],
)
def test_impossible_expert_layouts_name_the_numbers(arch, tp, ep, etp, match):
    hf_cfg = parse_hf_config({**_hf_config(arch, False), "num_attention_heads": 4, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match=match):
        ModelLayout(hf_cfg, tp_size=tp, pp_size=1, padded_vocab_size=32, ep_size=ep, etp_size=etp)


def test_unknown_names_are_key_errors():
    _, layout, _, _ = _setup("qwen2", False, 1, 1)
    with pytest.raises(KeyError, match="decoder.layers.7.mlp"):
        layout.to_hf_index("decoder.layers.7.mlp.linear_fc1.weight", torch.arange(3), 0, 0)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_norm.weight"):
        layout.to_local_index("model.layers.0.self_attn.q_norm.weight", torch.arange(3), 0, 0)


def test_explicit_stage_split_is_checked_and_used():
    hf_cfg = parse_hf_config(_hf_config("qwen2", False, 5))
    layout = ModelLayout(hf_cfg, tp_size=1, pp_size=2, padded_vocab_size=32, stage_layers=(1, 4))
    assert [layout.layer_offset(p) for p in (0, 1)] == [0, 1]
    assert "decoder.layers.3.mlp.linear_fc1.weight" in layout.shard(0, 1)
    assert "stage_layers=(1, 4)" in repr(layout)
    with pytest.raises(ValueError, match=r"stage_layers=\(2, 2\) does not split num_hidden_layers=5"):
        ModelLayout(hf_cfg, tp_size=1, pp_size=2, padded_vocab_size=32, stage_layers=(2, 2))
