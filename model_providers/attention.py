"""SDPA core attention for megatron's local layer spec (CPU and any GPU without TE).

Megatron's own `DotProductAttention` allocates from a CUDA memory buffer and materialises the score
matrix; this module calls `torch.nn.functional.scaled_dot_product_attention`, which runs everywhere
and uses fused kernels when the device has them. Attention dropout draws from megatron's
model-parallel RNG stream, as `DotProductAttention` does.

Grouped-query attention: on GPU, SDPA's `enable_gqa` reads each K/V head for its whole query group
(no copy); on CPU the K/V heads are repeated (`repeat_interleave`), which keeps the recorded CPU
numbers: the two agree bit for bit in fp32, forward and backward, and in bf16 forward, but bf16
K/V gradients are summed in another order (tests/test_sdpa_gqa.py).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Causal (or masked) attention over TP-local heads, with GQA.

    Shapes (megatron convention): query [s, b, h_q, d], key/value [s, b, h_kv, d], output
    [s, b, h_q * d]. `attention_mask`, when given, is megatron's boolean mask (True = masked out),
    broadcastable to [b, 1, s_q, s_k].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism; use the TE spec")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.native_gqa: bool | None = None  # SDPA's enable_gqa; None: on GPU (module docstring)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention_bias")
        s_q, b, h_q, d = query.shape
        h_kv = key.shape[2]
        q_bhsd, k_bhsd, v_bhsd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        native_gqa = h_kv != h_q and (query.is_cuda if self.native_gqa is None else self.native_gqa)
        if h_kv != h_q and not native_gqa:
            k_bhsd = k_bhsd.repeat_interleave(h_q // h_kv, dim=1)
            v_bhsd = v_bhsd.repeat_interleave(h_q // h_kv, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        keep_mask = None if attention_mask is None else ~attention_mask
        is_causal = keep_mask is None and mask_type == AttnMaskType.causal and s_q > 1
        dropout_p = self.dropout_p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext()
        with rng:
            out_bhsd = F.scaled_dot_product_attention(
                q_bhsd,
                k_bhsd,
                v_bhsd,
                attn_mask=keep_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=native_gqa,
            )
        return out_bhsd.permute(2, 0, 1, 3).reshape(s_q, b, h_q * d)
