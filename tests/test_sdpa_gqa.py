"""SDPA's native grouped-query attention (`enable_gqa`, the GPU path of `SDPACoreAttention`) against
the repeated K/V heads the CPU path keeps: bit-equal in fp32 (output and every gradient) and in the
bf16 output; bf16 K/V gradients within one bf16 rounding of the accumulated sum."""

from __future__ import annotations

import pytest
import torch

from model_providers.attention import SDPACoreAttention


def _attention(heads: int, groups: int) -> SDPACoreAttention:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * 16,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
    )
    return SDPACoreAttention(config, 1, AttnMaskType.causal, "self")


def _run(attn: SDPACoreAttention, native: bool, q, k, v):
    attn.native_gqa = native
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, None)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_enable_gqa_equals_repeated_kv(dtype):
    attn = _attention(heads=8, groups=2)
    g = torch.Generator().manual_seed(0)
    s, b, d = 24, 2, 16
    q = torch.randn(s, b, 8, d, generator=g).to(dtype)
    k, v = (torch.randn(s, b, 2, d, generator=g).to(dtype) for _ in range(2))
    repeated = _run(attn, False, q, k, v)
    native = _run(attn, True, q, k, v)
    assert repeated[0].shape == (s, b, 8 * d)
    assert torch.equal(native[0], repeated[0]) and torch.equal(native[1], repeated[1])
    if dtype == torch.float32:
        assert torch.equal(native[2], repeated[2]) and torch.equal(native[3], repeated[3])
    else:
        for ours, ref in zip(native[2:], repeated[2:], strict=True):
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=2**-6)


def test_default_is_repeated_kv_on_cpu():
    attn = _attention(heads=4, groups=2)
    q = torch.randn(8, 1, 4, 16)
    k, v = torch.randn(8, 1, 2, 16), torch.randn(8, 1, 2, 16)
    assert attn.native_gqa is None
    assert torch.equal(attn(q, k, v, None), _run(attn, False, q, k, v)[0])
