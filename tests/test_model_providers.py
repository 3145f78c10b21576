"""model_providers: HF config parsing across transformers versions, the architecture registry,
vocab padding, and the megatron config/spec built from it (no process group needed)."""

from __future__ import annotations

import itertools
import json

import pytest

from model_providers import ARCHITECTURES, build_spec, padded_vocab_size, parse_hf_config
from model_providers.attention import SDPACoreAttention
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
        ValueError, match=r"unsupported architecture: model_type='mistral'.*\['llama', 'qwen2', 'qwen3'\]"
    ):
        parse_hf_config({**tiny("llama"), "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    assert sorted(ARCHITECTURES) == ["llama", "qwen2", "qwen3"]


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
