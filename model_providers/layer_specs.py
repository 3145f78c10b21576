"""Megatron layer specs for the registered families: Transformer Engine on GPU when installed,
megatron's local modules with `SDPACoreAttention` otherwise.

Transformer Engine is imported lazily (only `te_available()` looks for it), so CPU installs and
package import never touch it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from model_providers.attention import SDPACoreAttention


def te_available() -> bool:
    """True when Transformer Engine is importable and a GPU is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def local_layer_spec(*, qk_norm: bool) -> ModuleSpec:
    """Megatron's local GPT layer (RMSNorm, SwiGLU MLP) with SDPA as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention.submodules = replace(attention.submodules, core_attention=SDPACoreAttention)
    return spec


def te_layer_spec(*, qk_norm: bool) -> ModuleSpec:
    """Megatron's Transformer Engine GPT layer (fused norm+linear, TE attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)


LAYER_SPECS = {"local": local_layer_spec, "transformer_engine": te_layer_spec}
TRANSFORMER_IMPLS = tuple(LAYER_SPECS)


def layer_spec(impl: str, *, qk_norm: bool, num_experts: int | None = None) -> ModuleSpec:
    """The decoder layer of `impl`; with `num_experts`, its MLP is a mixture of experts."""
    if impl not in LAYER_SPECS:
        raise ValueError(f"transformer_impl={impl!r}; choose one of {TRANSFORMER_IMPLS}")
    if num_experts is not None:
        from model_providers.moe import local_moe_layer_spec, te_moe_layer_spec

        build = local_moe_layer_spec if impl == "local" else te_moe_layer_spec
        return build(qk_norm=qk_norm, num_experts=num_experts)
    return LAYER_SPECS[impl](qk_norm=qk_norm)
