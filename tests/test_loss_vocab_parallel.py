"""Vocab-parallel log-prob/entropy against torch.log_softmax on the full vocabulary (single process).

The multi-rank check (real TP shards over gloo) runs in tests/test_loss_distributed.py.
"""

import pytest
import torch

from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs


def _reference(logits, target, vocab_size, temperature):
    z = logits[..., :vocab_size].double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature, chunk", [(1.0, 1024), (0.7, 3)])
def test_matches_log_softmax_values_and_gradients(temperature, chunk):
    torch.manual_seed(0)
    padded, real = 24, 21  # ids 21..23 are Megatron padding rows
    logits = (3 * torch.randn(5, 2, padded, dtype=torch.float64)).requires_grad_(True)
    target = torch.randint(0, real, (5, 2))
    logp, ent = vocab_parallel_logprobs(
        logits,
        target,
        group=None,
        vocab_start=0,
        vocab_size=real,
        temperature=temperature,
        chunk_tokens=chunk,
    )
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(ref_logits, target, real, temperature)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    w1, w2 = torch.randn(5, 2), torch.randn(5, 2)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert logits.grad[..., real:].abs().max() == 0


def test_bf16_logits_keep_fp32_math():
    torch.manual_seed(1)
    logits = torch.randn(7, 50).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, 50, (7,))
    logp, _ = vocab_parallel_logprobs(logits, target, group=None, vocab_start=0)
    ref, _ = _reference(logits.detach().float(), target, 50, 1.0)
    torch.testing.assert_close(logp.double(), ref, rtol=1e-5, atol=1e-5)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2), group=None, vocab_start=0, temperature=0)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(3), group=None, vocab_start=0)


def test_gradient_through_logp_only_matches_reference():
    """The entropy output unused (detached in the loss when its coefficient is 0)."""
    torch.manual_seed(2)
    logits = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (6,))
    logp, ent = vocab_parallel_logprobs(logits, target, group=None, vocab_start=0, chunk_tokens=4)
    (logp.sum() + ent.detach().sum()).backward()
    ref = logits.detach().clone().requires_grad_(True)
    _reference(ref, target, 40, 1.0)[0].sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)
