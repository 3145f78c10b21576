"""HF config -> megatron `TransformerConfig` + layer spec (`ModelSpec`) -> `GPTModel` for one stage.

`build_spec` is the single translation of an HF decoder config into megatron terms; everything
that builds a learner model (trainer, converter, verify, tests) goes through it, so all agree on
vocab padding, RoPE and norm settings. `build_model` instantiates the part of the model owned by
this rank's pipeline stage (`pre_process` = first stage, `post_process` = last stage).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from model_providers import rope
from model_providers.hf_config import HFModelConfig, Llama3RopeScaling, parse_hf_config
from model_providers.layer_specs import TRANSFORMER_IMPLS, layer_spec, te_available
from model_providers.moe import mark_expert_parameters, moe_transformer_fields
from model_providers.moe_config import MoEConfig
from model_providers.norms import RMSNorm
from model_providers.placement import place
from sparserl_mcore.parallel.config import ParallelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything needed to build (and to map weights into) the megatron model of one HF config."""

    arch: str
    hf: HFModelConfig
    parallel: ParallelConfig
    config: TransformerConfig
    layer_spec: ModuleSpec
    transformer_impl: str  # "local" (SDPA) or "transformer_engine"; parameter names differ
    params_dtype: torch.dtype
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    max_sequence_length: int
    stage_layers: tuple[int, ...]  # decoder layers per pipeline stage (`ParallelConfig.stage_layers`)
    moe: MoEConfig = MoEConfig()  # router training choices (MoE families only)

    @property
    def grouped_experts(self) -> bool:
        """Experts as one grouped-GEMM module (`experts.linear_fc1.weight<j>`, TE spec) rather than
        megatron's `SequentialMLP` (`experts.local_experts.<j>.linear_fc1.weight`)."""
        return bool(self.config.moe_grouped_gemm)


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Megatron's padding: the smallest multiple of `multiple * tp_size` holding `vocab_size`."""
    if multiple < 1:
        raise ValueError(f"vocab_multiple={multiple}: must be >= 1")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def _transformer_config(
    hf: HFModelConfig,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    cpu: bool,
    moe: MoEConfig,
    impl: str,
    wgrad_fusion: bool,
    rope_cache: bool,
) -> TransformerConfig:
    stages = parallel.stage_layers(hf.num_layers)
    uneven = len(set(stages)) > 1  # megatron's own default is equal stages
    return TransformerConfig(
        num_layers=hf.num_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.ffn_hidden_size,
        num_attention_heads=hf.num_heads,
        num_query_groups=hf.num_kv_heads,
        kv_channels=hf.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.qkv_bias,
        qk_layernorm=hf.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf.initializer_range,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=stages[0] if uneven else None,
        num_layers_in_last_pipeline_stage=stages[-1] if uneven else None,
        context_parallel_size=parallel.context_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu,
        # Fused kernels exist only on GPU (and some only with TE/apex); the unfused paths are exact.
        bias_activation_fusion=not cpu,
        bias_dropout_fusion=not cpu,
        # the local spec: megatron's fused-RoPE slot holds `rope.apply_cached` (cos/sin cached)
        apply_rope_fusion=rope_cache,
        masked_softmax_fusion=False,
        # TE fuses it itself; the local spec calls the top-level `fused_weight_gradient_mlp_cuda`
        gradient_accumulation_fusion=wgrad_fusion,
        persist_layer_norm=False,
        **moe_transformer_fields(hf, parallel, moe, grouped_gemm=impl == "transformer_engine"),
    )


def build_spec(
    hf_config: Mapping[str, Any] | str | Path,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype | str = torch.float32,
    vocab_multiple: int = 128,
    transformer_impl: str | None = None,
    cpu: bool | None = None,
    moe: MoEConfig | None = None,
    wgrad_fusion: bool | None = None,
    rope_cache: bool | None = None,
) -> ModelSpec:
    """Translate an HF config (dict, config.json or checkpoint dir) into a `ModelSpec` for `parallel`.

    `transformer_impl` defaults to "transformer_engine" when TE is importable on a GPU, else "local".
    `cpu` (default: no CUDA available) selects CPU initialisation and turns fused kernels off.
    `moe`: how MoE routers train (the run config's `model.moe`; default `MoEConfig()`; unused for
    dense models).
    `wgrad_fusion` (default: not `cpu`): megatron's gradient-accumulation fusion, weight gradients
    added straight into DDP's fp32 `main_grad` (the model must be trained wrapped in megatron DDP).
    `rope_cache` (default: on for the local spec): RoPE cos/sin tables computed once per sequence
    length instead of twice per layer per forward (`model_providers.rope`; bit-identical); False is
    megatron's unfused RoPE.
    """
    hf = parse_hf_config(hf_config)
    moe = moe or MoEConfig()
    parallel.validate_model(**hf.layout_shape())
    dtype = _DTYPES.get(params_dtype) if isinstance(params_dtype, str) else params_dtype
    if dtype not in _DTYPES.values():
        raise ValueError(f"params_dtype={params_dtype!r}; choose one of {sorted(_DTYPES)}")
    assert dtype is not None  # for the type checker: one of _DTYPES' values
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    impl = transformer_impl or ("transformer_engine" if not cpu and te_available() else "local")
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={impl!r}; choose one of {TRANSFORMER_IMPLS}")
    if impl == "local" and parallel.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={parallel.context_parallel_size} needs the transformer_engine spec "
            "(GPU with transformer_engine installed); the local SDPA attention has no context parallelism"
        )
    cached_rope = impl == "local" and rope_cache is not False and rope.install()
    if rope_cache and not cached_rope:
        raise ValueError(
            f"rope_cache=True needs the local spec without transformer-engine's fused RoPE "
            f"(transformer_impl={impl!r}); leave rope_cache unset"
        )
    return ModelSpec(
        arch=hf.arch,
        hf=hf,
        parallel=parallel,
        config=_transformer_config(
            hf,
            parallel,
            dtype,
            cpu,
            moe,
            impl,
            (not cpu) if wgrad_fusion is None else wgrad_fusion,
            cached_rope,
        ),
        layer_spec=layer_spec(impl, qk_norm=hf.qk_norm, num_experts=hf.moe.num_experts if hf.moe else None),
        transformer_impl=impl,
        params_dtype=dtype,
        vocab_size=hf.vocab_size,
        padded_vocab_size=padded_vocab_size(
            hf.vocab_size, parallel.tensor_model_parallel_size, vocab_multiple
        ),
        tie_embeddings=hf.tie_embeddings,
        max_sequence_length=hf.max_position_embeddings,
        stage_layers=parallel.stage_layers(hf.num_layers),
        moe=moe,
    )


def build_model(
    spec: ModelSpec,
    *,
    device: torch.device | str,
    pre_process: bool,
    post_process: bool,
    pg_collection: Any | None = None,
    parallel_output: bool = True,
) -> GPTModel:
    """The GPTModel part of one pipeline stage (needs `parallel.initialize` to have run), with every
    parameter, buffer and tensor attribute on `device` (the runtime's) and parameters in
    `spec.params_dtype` (`placement.place`).

    `parallel_output=True` keeps logits vocab-sharded over TP ([s, b, padded_vocab / TP]), which is
    what vocab-parallel log-prob code wants. Weights are random; load them with `sparserl_mcore.ckpt`.
    """
    hf = spec.hf
    model = GPTModel(
        config=spec.config,
        transformer_layer_spec=_block_spec(spec, pg_collection),
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=hf.rope_theta,
        pg_collection=pg_collection,
    )
    if hf.rope_scaling is not None:
        _apply_llama3_rope_scaling(model, hf.rope_scaling)
    if hf.moe is not None:
        mark_expert_parameters(model)
    return place(model, device, spec.params_dtype)


def _block_spec(spec: ModelSpec, pg_collection: Any | None) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec, or for MoE models on the local spec the whole block's submodules: megatron
    builds a block's final norm with its default norm, which refuses sequence parallelism."""
    if spec.hf.moe is None or spec.transformer_impl != "local":
        return spec.layer_spec
    if pg_collection is not None:
        pp_rank = pg_collection.pp.rank()
    else:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    layers = spec.stage_layers[pp_rank]
    return TransformerBlockSubmodules(layer_specs=[spec.layer_spec] * layers, layer_norm=RMSNorm)


def _apply_llama3_rope_scaling(model: GPTModel, scaling: Llama3RopeScaling) -> None:
    """Scale RoPE frequencies with the checkpoint's own Llama-3 constants.

    GPTModel(rope_scaling=True) only takes `factor` and fixes the other three constants to Llama
    3.1's values (1, 4, 8192); megatron's `_apply_scaling` accepts them all, so apply it here.
    """
    rope = model.rotary_pos_emb
    rope.inv_freq = rope._apply_scaling(
        rope.inv_freq,
        factor=scaling.factor,
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )
