"""model_providers: HF config parsing across transformers versions, the architecture registry,
vocab padding, and the megatron config/spec built from it (no process group needed)."""

from __future__ import annotations

import itertools
import json

import pytest

from model_providers import ARCHITECTURES, MoEArch, build_spec, padded_vocab_size, parse_hf_config
from model_providers.attention import SDPACoreAttention
from model_providers.moe_config import MoEConfig
from sparserl_mcore.ckpt.tiny import TinyModelConfig, hf_config
from sparserl_mcore.parallel import ParallelConfig

LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny(arch: str, **kwargs) -> dict:
    return hf_config(TinyModelConfig(arch=arch, **kwargs)).to_dict()


def test_registered_families_parse():
    qwen2 = parse_hf_config(tiny("qwen2", tie_embeddings=True))
    assert (qwen2.arch, qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_embeddings) == ("qwen2", True, False, True)
    assert qwen2.rope_scaling is None and qwen2.rope_theta == 1e6

    qwen3 = parse_hf_config(tiny("qwen3", head_dim=24))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.hidden_size) == (False, True, 24, 64)

    llama = parse_hf_config(tiny("llama"))
    assert llama.rope_theta == 5e5 and llama.rope_scaling.factor == 8.0
    assert llama.rope_scaling.original_max_position_embeddings == 512


def test_pre_transformers5_rope_fields_parse_the_same(tmp_path):
    new_style = tiny("llama")
    old_style = {k: v for k, v in new_style.items() if k != "rope_parameters"}
    old_style["rope_theta"] = 5e5
    old_style["rope_scaling"] = {k: v for k, v in new_style["rope_parameters"].items() if k != "rope_theta"}
    (tmp_path / "config.json").write_text(json.dumps(old_style))
    assert parse_hf_config(tmp_path) == parse_hf_config(new_style)


def test_architectures_field_resolves_and_unknown_lists_supported():
    config = tiny("qwen2")
    config["model_type"], config["architectures"] = None, ["Qwen2ForCausalLM"]
    assert parse_hf_config(config).arch == "qwen2"
    with pytest.raises(
        ValueError, match=r"unsupported architecture: model_type='mistral'.*\['llama', 'qwen2', 'qwen2_moe'"
    ):
        parse_hf_config({**tiny("llama"), "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    assert sorted(ARCHITECTURES) == ["llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"rope_type='yarn' is not supported for qwen2",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"use_sliding_window": True}, r"use_sliding_window=true is not supported"),
    ],
)
def test_unsupported_features_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**tiny("qwen2"), **change})


def test_vocab_padding_is_megatrons():
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151936, 2) == 152064
    assert padded_vocab_size(200, 1) == 256
    assert padded_vocab_size(200, 4, multiple=64) == 256
    with pytest.raises(ValueError, match="vocab_multiple=0"):
        padded_vocab_size(200, 1, multiple=0)


def test_build_spec_translates_the_config():
    hf = {
        **tiny("qwen3", head_dim=24, vocab=200),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    spec = build_spec(hf, ParallelConfig(tensor_model_parallel_size=2), params_dtype="bfloat16", cpu=True)
    cfg = spec.config
    assert (spec.arch, spec.transformer_impl, spec.vocab_size, spec.padded_vocab_size) == (
        "qwen3",
        "local",
        200,
        256,
    )
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.qk_layernorm, cfg.add_qkv_bias) == (24, 2, True, False)
    assert cfg.gated_linear_unit and not cfg.add_bias_linear and cfg.normalization == "RMSNorm"
    assert cfg.bf16 and cfg.tensor_model_parallel_size == 2 and cfg.use_cpu_initialization
    assert spec.layer_spec.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert build_spec(tiny("qwen2"), ParallelConfig()).config.add_qkv_bias


def test_build_spec_rejects_impossible_layouts_and_dtypes():
    with pytest.raises(
        ValueError, match="tensor_model_parallel_size=4 does not divide num_key_value_heads=2"
    ):
        build_spec(tiny("llama"), ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(ValueError, match=r"params_dtype='float16'; choose one of \['bfloat16', 'float32'\]"):
        build_spec(tiny("llama"), ParallelConfig(), params_dtype="float16")
    with pytest.raises(ValueError, match="context_parallel_size=2 needs the transformer_engine spec"):
        build_spec(tiny("llama"), ParallelConfig(context_parallel_size=2), cpu=True)
    with pytest.raises(ValueError, match="transformer_impl='apex'"):
        build_spec(tiny("llama"), ParallelConfig(), transformer_impl="apex")


def _megatron_stages(spec) -> list[tuple[int, int]]:
    """(layer offset, layers built) of every stage, as megatron-core itself computes them."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = spec.parallel.pipeline_model_parallel_size
    return [
        (
            get_transformer_layer_offset(spec.config, pp_rank=p),
            get_num_layers_to_build(spec.config, pp_rank=p),
        )
        for p in range(pp)
    ]


def _splits_megatron_allows(layers: int, pp: int) -> list[tuple[int, ...]]:
    """Every split into `pp` stages of >= 1 layer whose middle stages are equal (megatron's rule)."""
    splits = []
    for cuts in itertools.combinations(range(1, layers), pp - 1):
        bounds = (0, *cuts, layers)
        counts = tuple(b - a for a, b in itertools.pairwise(bounds))
        if len(set(counts[1:-1])) <= 1:
            splits.append(counts)
    return splits


def test_default_stage_split_is_balanced_and_is_megatrons_for_every_pp():
    for layers in range(1, 11):
        for pp in range(1, layers + 1):
            spec = build_spec(tiny("qwen2", layers=layers), ParallelConfig(pipeline_model_parallel_size=pp))
            counts = spec.stage_layers
            allowed = _splits_megatron_allows(layers, pp)
            assert counts in allowed, (layers, pp, counts)
            assert max(counts) == min(max(c) for c in allowed), (layers, pp, counts)  # least busiest stage
            if layers % pp == 0:  # equal stages stay megatron's plain (even) split
                assert spec.config.num_layers_in_first_pipeline_stage is None
            offsets = [sum(counts[:p]) for p in range(pp)]
            assert _megatron_stages(spec) == list(zip(offsets, counts, strict=True)), (layers, pp)
    # the common real shapes: 28 layers on PP=3, 36 on PP=5, 5 on PP=2 / PP=3
    for layers, pp, want in (
        (28, 3, (9, 10, 9)),
        (36, 5, (8, 7, 7, 7, 7)),
        (5, 2, (3, 2)),
        (5, 3, (2, 2, 1)),
    ):
        assert ParallelConfig(pipeline_model_parallel_size=pp).stage_layers(layers) == want


@pytest.mark.parametrize(
    ("first", "last", "want"),
    [(1, None, (1, 2, 2)), (None, 3, (1, 1, 3)), (3, 1, (3, 1, 1)), (1, 1, (1, 3, 1))],
)
def test_stage_split_overrides_follow_megatron(first, last, want):
    parallel = ParallelConfig(
        pipeline_model_parallel_size=3,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    spec = build_spec(tiny("llama", layers=5), parallel)
    assert spec.stage_layers == want
    assert _megatron_stages(spec) == [(sum(want[:p]), n) for p, n in enumerate(want)]


@pytest.mark.parametrize(
    ("pp", "first", "last", "message"),
    [
        (
            4,
            1,
            None,
            r"num_layers_in_first_pipeline_stage=1: 4 of num_hidden_layers=5 remain for 3 middle",
        ),
        (
            2,
            2,
            2,
            r"=2: 1 of num_hidden_layers=5 remain for the other 0 of pipeline_model_parallel_size=2 stages",
        ),
        (3, 4, None, r"stage=4: 1 of num_hidden_layers=5 remain for the other 2 of"),
        (1, 2, None, r"num_layers_in_first_pipeline_stage=2 needs pipeline_model_parallel_size > 1"),
        (2, 0, None, r"num_layers_in_first_pipeline_stage=0: must be an integer >= 1"),
    ],
)
def test_impossible_stage_splits_name_the_numbers(pp, first, last, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(
            pipeline_model_parallel_size=pp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
        ).stage_layers(5)


# ---- mixtures of experts ---------------------------------------------------------------------


def test_moe_families_parse_their_routing():
    qwen3 = parse_hf_config(tiny("qwen3_moe", experts=8, top_k=2, expert_ffn=24))
    assert (qwen3.arch, qwen3.qk_norm, qwen3.qkv_bias) == ("qwen3_moe", True, False)
    assert qwen3.moe == MoEArch(
        num_experts=8, top_k=2, expert_ffn_hidden_size=24, norm_topk_prob=True, router_aux_loss_coef=0.001
    )
    qwen2 = parse_hf_config(tiny("qwen2_moe", shared_expert_ffn=40))
    assert qwen2.qkv_bias and not qwen2.moe.norm_topk_prob and qwen2.moe.shared_expert_ffn_hidden_size == 40
    shapes = qwen2.tensor_shapes()
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes  # no dense MLP
    # the Hub's config.json names the expert count `num_experts`, transformers 5 `num_local_experts`
    hub = {k: v for k, v in tiny("qwen3_moe").items() if k != "num_local_experts"} | {"num_experts": 4}
    assert parse_hf_config(hub) == parse_hf_config(tiny("qwen3_moe"))


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\].*every layer must be MoE"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2: dense MLP layers"),
        ("qwen3_moe", {"moe_intermediate_size": None}, r"lacks the required field 'moe_intermediate_size'"),
        (
            "qwen3_moe",
            {"num_experts_per_tok": 9},
            r"num_experts_per_tok=9 must be between 1 and num_experts=4",
        ),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0"),
    ],
)
def test_unsupported_moe_configs_are_named(arch, change, message):
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**tiny(arch), **change})


def test_build_spec_maps_hf_routing_onto_megatrons_router():
    from model_providers.moe import TorchGatingRouter

    par = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    qwen3 = build_spec(tiny("qwen3_moe"), par, cpu=True).config
    # norm_topk_prob: top-k of the logits, then softmax over the k (megatron's default order)
    assert (qwen3.num_moe_experts, qwen3.moe_router_topk, qwen3.moe_ffn_hidden_size) == (4, 2, 32)
    assert not qwen3.moe_router_pre_softmax and qwen3.moe_router_score_function == "softmax"
    assert (qwen3.moe_router_load_balancing_type, qwen3.moe_aux_loss_coeff) == ("aux_loss", 0.001)
    assert qwen3.sequence_parallel and qwen3.expert_model_parallel_size == 2  # MoE with TP > 1 needs SP
    assert qwen3.moe_token_dispatcher_type == "alltoall" and qwen3.moe_router_dtype == "fp32"
    assert qwen3.moe_shared_expert_intermediate_size is None and not qwen3.moe_grouped_gemm
    qwen2 = build_spec(tiny("qwen2_moe"), ParallelConfig(), cpu=True, moe=MoEConfig(load_balancing="none"))
    # no renormalisation: softmax over all experts, then top-k (megatron's pre-softmax)
    assert qwen2.config.moe_router_pre_softmax and not qwen2.config.sequence_parallel
    assert qwen2.config.moe_shared_expert_intermediate_size == 48 and qwen2.config.moe_shared_expert_gate
    assert (qwen2.config.moe_router_load_balancing_type, qwen2.config.moe_aux_loss_coeff) == ("none", 0.0)
    mlp = qwen2.layer_spec.submodules.mlp
    assert mlp.submodules.router is TorchGatingRouter
    overridden = build_spec(tiny("qwen3_moe"), ParallelConfig(), moe=MoEConfig(aux_loss_coeff=0.01)).config
    assert overridden.moe_aux_loss_coeff == 0.01


def test_moe_router_settings_the_model_cannot_take_are_refused():
    from model_providers.moe_config import check_moe_config

    with pytest.raises(ValueError, match=r"load_balancing='expert_bias'.*needs sigmoid router scores"):
        build_spec(tiny("qwen3_moe"), ParallelConfig(), moe=MoEConfig(load_balancing="expert_bias"))
    with pytest.raises(
        ValueError, match=r"routing_replay=true: qwen3 is a dense model, it routes no experts"
    ):
        check_moe_config(parse_hf_config(tiny("qwen3")), MoEConfig(routing_replay=True))
    with pytest.raises(ValueError, match=r"aux_loss_coeff=0.1 with load_balancing='none'"):
        MoEConfig(load_balancing="none", aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match=r"load_balancing='sinkhorn'; choose one of aux_loss"):
        MoEConfig(load_balancing="sinkhorn")
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=3 does not divide num_experts=4"):
        build_spec(tiny("qwen3_moe"), ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=2, .*the model has no experts"):
        build_spec(tiny("qwen3"), ParallelConfig(expert_model_parallel_size=2))
