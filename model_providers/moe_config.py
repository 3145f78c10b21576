"""How the learner trains mixture-of-experts routers (`model.moe` in the run config).

Pure Python, read before any process starts. The routing itself (experts, top-k, softmax before or
after the top-k) is the checkpoint's (`hf_config.MoEArch`); these are the training choices around
it, in megatron-core's terms (`model_providers.moe.moe_transformer_fields` turns them into
`TransformerConfig` fields):

- `load_balancing`: megatron's `moe_router_load_balancing_type`: "aux_loss" (GShard / Switch loss
  per micro-batch), "seq_aux_loss" (per sequence, DeepSeek-V2/V3), "global_aux_loss" (over the
  global batch), "expert_bias" (aux-loss-free: a per-expert bias added to the scores for the top-k
  choice only, moved by `expert_bias_update_rate` towards balance after each step; megatron needs
  sigmoid scores for it, DeepSeek-V3 style) or "none";
- `aux_loss_coeff`: the loss's weight; null takes the checkpoint's `router_aux_loss_coef`;
- `z_loss_coeff`: ST-MoE's router z-loss (null: off);
- `router_dtype`: the precision of the router's logits, softmax and top-k (megatron's
  `moe_router_dtype`; fp32 keeps the top-k stable in a bf16 model, what RL recipes use);
- `routing_replay`: build the routers with megatron's `RouterReplay` hook
  (`moe_enable_routing_replay`), through which given expert choices replace the router's own top-k
  (rollout routing replay: `model_providers.routing_replay`, which replays the engines' ids where
  given and keeps the router's own top-k elsewhere); a dense checkpoint refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_providers.hf_config import HFModelConfig

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "expert_bias", "none")
ROUTER_DTYPES = ("fp32", "fp64", "params")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Router training settings of an MoE policy (ignored for dense models); see the module docstring."""

    load_balancing: str = "aux_loss"
    aux_loss_coeff: float | None = None
    expert_bias_update_rate: float = 1e-3
    z_loss_coeff: float | None = None
    router_dtype: str = "fp32"
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(
                f"load_balancing={self.load_balancing!r}; choose one of {', '.join(LOAD_BALANCING)}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"router_dtype={self.router_dtype!r}; choose one of {', '.join(ROUTER_DTYPES)} "
                "(params: the model's own dtype)"
            )
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(
                    f"{name}={value}: must be >= 0 (null: {'the checkpoint' if 'aux' in name else 'off'})"
                )
        if self.expert_bias_update_rate <= 0:
            raise ValueError(f"expert_bias_update_rate={self.expert_bias_update_rate}: must be > 0")
        if self.load_balancing in ("none", "expert_bias") and self.aux_loss_coeff:
            raise ValueError(
                f"aux_loss_coeff={self.aux_loss_coeff} with load_balancing={self.load_balancing!r}: "
                "no aux loss is computed; drop aux_loss_coeff or pick an *aux_loss balancing"
            )


def check_moe_config(hf: HFModelConfig, moe: MoEConfig) -> None:
    """Refuse router training choices the checkpoint's routing cannot take, naming why."""
    if hf.moe is None:
        if moe.routing_replay:
            raise ValueError(
                f"model.moe.routing_replay=true: {hf.arch} is a dense model, it routes no experts; "
                "leave it false"
            )
        return
    if moe.load_balancing == "expert_bias":
        raise ValueError(
            f"model.moe.load_balancing='expert_bias': megatron's aux-loss-free balancing needs sigmoid "
            f"router scores (DeepSeek-V3 style), and {hf.arch} routes by softmax; its checkpoints and "
            "SGLang's model also have no bias for the rollout engines to route with. Use aux_loss, "
            "seq_aux_loss, global_aux_loss or none"
        )
