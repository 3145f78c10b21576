"""Mixture-of-experts layers for the registered MoE families (Qwen3-MoE, Qwen2-MoE) in megatron terms.

`moe_transformer_fields` turns the checkpoint's routing (`hf_config.MoEArch`), the run's router
training choices (`moe_config.MoEConfig`) and the expert layout (`ParallelConfig`) into megatron
`TransformerConfig` fields; `local_moe_layer_spec` is megatron's local MoE layer with the pieces a
machine without Transformer Engine needs:

- `TorchGatingRouter`: megatron 0.16.1's `TopKRouter.gating` goes through
  `moe_utils.router_gating_linear`, whose autograd function calls `te_general_gemm`, a name
  `moe_utils` defines only when `import transformer_engine` succeeds (moe_utils.py lines 21-39
  and 1192 / 1225): every MoE forward without TE dies with `NameError`. This router computes the
  same logits with a plain torch linear in the router dtype (the seam megatron offers:
  `MoESubmodules.router`), so no megatron module is patched; both specs use it (a [tokens, E]
  projection: what kernel computes it does not matter), and it counts what it routes (telemetry).
- `RMSNorm` for every norm (`model_providers.norms`): megatron requires sequence parallelism with
  TP > 1 in MoE training (`moe_layer.py`: MoELayer.forward), which its torch norm refuses.
- `SequentialMLP` experts (one megatron MLP per local expert): `moe_grouped_gemm` needs the CUDA
  `grouped_gemm` package or TE's grouped linear.

HF routing maps onto megatron's top-k router as: softmax over all experts then top-k without
renormalisation (`norm_topk_prob` false: Qwen2-MoE) = `moe_router_pre_softmax=True`; top-k of the
logits then softmax over the k (`norm_topk_prob` true: Qwen3-MoE; equal to renormalising the
top-k of the full softmax) = `moe_router_pre_softmax=False`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from model_providers.attention import SDPACoreAttention
from model_providers.hf_config import HFModelConfig
from model_providers.moe_config import MoEConfig, check_moe_config
from model_providers.norms import RMSNorm
from model_providers.routing_replay import MergingReplay
from sparserl_mcore.parallel.config import ParallelConfig

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TorchGatingRouter(TopKRouter):
    """megatron's `TopKRouter` with its gating as a torch linear (see the module docstring), which
        also counts what it routes in training passes (forward with gradients; not the log-prob
        recompute): `tokens_per_expert` [E] (token-to-expert assignments of this rank's real tokens,
    padding left out when the forward passes megatron's padding mask) and the
        load-balancing loss it computed (`aux_loss_sum` = [sum, micro-batches], without its coefficient,
        megatron's logging convention; under TP each rank's value is its tokens' part of the
        micro-batch's loss). `take_stats` reads and resets them."""

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        # plain tensor attributes, not buffers: `placement.place` moves them without casting them
        # to the params dtype, and checkpoints never see them
        self.tokens_per_expert = torch.zeros(self.config.num_moe_experts, dtype=torch.int64)
        self.aux_loss_sum = torch.zeros(2, dtype=torch.float64)
        if self.config.moe_enable_routing_replay:  # R3: given ids merged with its own top-k
            self.router_replay = MergingReplay()

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype or "", input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():  # real tokens only: padding routes somewhere, but counts nowhere
                real = routing_map if padding_mask is None else routing_map & ~padding_mask.reshape(-1, 1)
                self.tokens_per_expert += real.sum(dim=0)
        return probs, routing_map

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, *args, **kwargs):
        with torch.no_grad():  # [sum, count]: this rank's tokens' part of each micro-batch's loss
            self.aux_loss_sum += torch.stack(
                [aux_loss.detach().double() / aux_loss_coeff, aux_loss.new_ones(()).double()]
            )
        return super().attach_and_log_load_balancing_loss(
            activation, aux_loss_coeff, aux_loss, *args, **kwargs
        )

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_per_expert [E] int64, [aux loss sum, micro-batches] float64) since the last call."""
        stats = self.tokens_per_expert.clone(), self.aux_loss_sum.clone()
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        return stats


def mark_expert_parameters(model: torch.nn.Module) -> None:
    """Tag routed experts' parameters as expert-parallel (`allreduce=False`) at every EP size.

    megatron tags them only when EP > 1 (`tensor_parallel/layers.py`: `allreduce = not (is_expert
    and expert_parallel)`), so at EP = 1 they join the dense gradient buffers and the dense
    optimizer, and at EP > 1 they get their own (`get_megatron_optimizer` chains a dense and an
    expert optimizer). Their optimizer state is then keyed differently in a dist checkpoint
    (`chained_1.` versus none), and a run saved at EP = 2 could not resume at EP = 1 or the other
    way round. Tagged always, they always get the expert optimizer; at EP = 1 its data-parallel
    group is the dense one, so the training is unchanged."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False  # type: ignore[attr-defined]


def moe_transformer_fields(
    hf: HFModelConfig, parallel: ParallelConfig, moe: MoEConfig, *, grouped_gemm: bool
) -> dict[str, Any]:
    """megatron `TransformerConfig` fields of the MoE layers ({} for a dense model)."""
    if hf.moe is None:
        return {}
    check_moe_config(hf, moe)
    arch = hf.moe
    balancing = moe.load_balancing
    coeff = arch.router_aux_loss_coef if moe.aux_loss_coeff is None else moe.aux_loss_coeff
    if balancing.endswith("aux_loss") and coeff == 0:
        balancing = "none"
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.top_k,
        "moe_ffn_hidden_size": arch.expert_ffn_hidden_size,
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none" if balancing == "expert_bias" else balancing,
        "moe_router_enable_expert_bias": balancing == "expert_bias",
        "moe_router_bias_update_rate": moe.expert_bias_update_rate,
        "moe_aux_loss_coeff": coeff if balancing.endswith("aux_loss") else 0.0,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_router_dtype": None if moe.router_dtype == "params" else moe.router_dtype,
        "moe_enable_routing_replay": moe.routing_replay,
        "moe_token_dispatcher_type": parallel.moe_token_dispatcher_type,
        "moe_shared_expert_intermediate_size": arch.shared_expert_ffn_hidden_size,
        "moe_shared_expert_gate": arch.shared_expert_ffn_hidden_size is not None,
        "moe_grouped_gemm": grouped_gemm,
        "moe_permute_fusion": False,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
        # megatron refuses MoE training with TP > 1 without it (MoELayer.forward)
        "sequence_parallel": parallel.tensor_model_parallel_size > 1,
    }


def local_moe_layer_spec(*, qk_norm: bool, num_experts: int) -> ModuleSpec:
    """megatron's local MoE layer: SDPA attention, `RMSNorm` norms, `TorchGatingRouter`,
    `SequentialMLP` experts (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    layer = spec.submodules
    attention = layer.self_attention
    attn_sub = replace(attention.submodules, core_attention=SDPACoreAttention)
    if qk_norm:
        attn_sub = replace(attn_sub, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
    attention.submodules = attn_sub
    mlp = layer.mlp
    mlp.submodules = replace(mlp.submodules, router=TorchGatingRouter)
    spec.submodules = replace(layer, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return spec


def te_moe_layer_spec(*, qk_norm: bool, num_experts: int) -> ModuleSpec:
    """megatron's Transformer Engine MoE layer (grouped-GEMM experts) with `TorchGatingRouter`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=True, qk_layernorm=qk_norm
    )
    mlp = spec.submodules.mlp
    mlp.submodules = replace(mlp.submodules, router=TorchGatingRouter)
    return spec
