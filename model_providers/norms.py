"""An RMSNorm that megatron's layer specs can build and that works under sequence parallelism.

megatron's torch norm (`transformer/torch_norm.py: WrappedTorchNorm`) asserts
`not config.sequence_parallel`, and its TE / Apex norms need those packages. Under sequence
parallelism every TP rank normalises its own slice of the tokens, so the norm weight's gradient
is partial on each rank: megatron's `finalize_model_grads` sums it over TP for parameters tagged
`sequence_parallel=True` (and for q/k layernorms by name), which this module tags. The math is
`torch.nn.RMSNorm`'s, so without sequence parallelism it equals the torch norm exactly.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` built with megatron's norm arguments; the weight is tagged for sequence
    parallelism when the config turns it on."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"RMSNorm: normalization={normalization!r}, zero-centred gamma are not supported"
            )
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
