"""The fused head + log-prob (loss/fused_logprob.py) against the output layer + vocab_parallel_logprobs.

The oracle is today's path: logits = hidden @ W^T (megatron's output layer on the last stage) into
`vocab_parallel_logprobs`. fp32, padded vocabulary, temperature != 1, several chunks; TP = 2 over
gloo in real processes (tests/fused_logprob_worker.py). Tolerances are relative to each tensor's
largest entry: log-probs and the gradients of hidden and weight 1e-6, entropy 1e-5. The op counts
of one micro-batch (0 `nonzero`, 0 `bmm`) are pinned with a dispatch-mode counter. The end-to-end
check through megatron-core's update is tests/test_loss_distributed.py (fused vs oracle reference).
"""

import collections
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparserl_mcore.loss.fused_logprob import linear_logprobs
from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs
from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("fused_logprob_worker.py"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def oracle(hidden, weight, target, *, vocab_size, temperature, grads):
    """Today's path: full logits from the output layer, then vocab_parallel_logprobs; and its grads."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs(
        h @ w.t(), target, group=None, vocab_start=0, vocab_size=vocab_size, temperature=temperature
    )
    g_lp, g_h = grads
    (logp * g_lp).sum().add((ent * g_h).sum() if g_h is not None else 0).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def inputs(n=37, h=16, padded=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, h, generator=gen),
        0.5 * torch.randn(padded, h, generator=gen),
        torch.randint(0, 45, (n,), generator=gen),
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
    )


@pytest.mark.parametrize("temperature, with_entropy", [(1.0, True), (0.7, True), (1.3, False)])
def test_matches_output_layer_plus_vocab_parallel(temperature, with_entropy):
    hidden, weight, target, g_lp, g_h = inputs()
    g_h = g_h if with_entropy else None
    want = oracle(hidden, weight, target, vocab_size=45, temperature=temperature, grads=(g_lp, g_h))
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    # 4 bytes x 48 columns x 5 tokens: 8 chunks, the last one short
    logp, ent = linear_logprobs(
        h,
        w,
        target,
        group=None,
        vocab_start=0,
        vocab_size=45,
        temperature=temperature,
        chunk_bytes=4 * 48 * 5,
    )
    (logp * g_lp).sum().add((ent * g_h).sum() if g_h is not None else 0).backward()
    assert rel(logp, want[0]) <= 1e-6
    assert rel(ent, want[1]) <= 1e-5
    assert rel(h.grad, want[2]) <= 1e-6
    assert rel(w.grad, want[3]) <= 1e-6
    assert w.grad[45:].abs().max() == 0  # padding rows get no gradient


def test_weight_gradient_follows_megatrons_main_grad_protocol():
    """gradient_accumulation_fusion: dW is added to main_grad in fp32 and a dummy returned (zeros with
    zero_out_wgrad, so DDP's hook adds a tied embedding's own gradient on top), as megatron's layer."""
    hidden, weight, target, g_lp, _ = inputs(seed=1)
    _, _, _, dw = oracle(hidden, weight, target, vocab_size=45, temperature=0.9, grads=(g_lp, None))
    for fusion, zero_out in ((True, False), (True, True), (False, False)):
        w = weight.clone().requires_grad_(True)
        before = torch.randn(w.shape)
        w.main_grad = before.clone()
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = zero_out
        logp, _ = linear_logprobs(
            hidden,
            w,
            target,
            group=None,
            vocab_start=0,
            vocab_size=45,
            temperature=0.9,
            gradient_accumulation_fusion=fusion,
        )
        (logp * g_lp).sum().backward()
        if fusion:
            assert w.grad_added_to_main_grad
            assert rel(w.main_grad - before, dw) <= 1e-6
            if zero_out:
                assert w.grad.abs().max() == 0
        else:
            assert not w.grad_added_to_main_grad and torch.equal(w.main_grad, before)
            assert rel(w.grad, dw) <= 1e-6


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_one_micro_batch_runs_no_nonzero_and_no_bmm():
    """Per log-prob micro-batch (fwd + bwd, 8 chunks): no host-syncing `nonzero`, no GEMV-shaped bmm.
    The same counter sees today's einsum bmm and a plain nonzero, so it can tell."""
    hidden, weight, target, g_lp, g_h = inputs(seed=2)
    counts = {}
    for name in ("fused", "today"):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with OpCounter() as counter:
            if name == "fused":
                logp, ent = linear_logprobs(
                    h, w, target, group=None, vocab_start=0, vocab_size=45, chunk_bytes=4 * 48 * 5
                )
            else:
                logp, ent = vocab_parallel_logprobs(
                    h @ w.t(), target, group=None, vocab_start=0, vocab_size=45, chunk_tokens=5
                )
            ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
        counts[name] = counter.ops
    assert counts["fused"]["nonzero"] == 0 and counts["fused"]["bmm"] == 0, counts["fused"]
    assert counts["today"]["bmm"] > 0
    with OpCounter() as counter:
        torch.nonzero(target > 3)
    assert counter.ops["nonzero"] == 1


def test_rejects_bad_arguments():
    hidden, weight, target, _, _ = inputs()
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(hidden, weight, target, group=None, vocab_start=0, temperature=0)
    with pytest.raises(ValueError, match="must be \\[N, H\\]"):
        linear_logprobs(hidden, weight[:, :3], target, group=None, vocab_start=0)
    with pytest.raises(ValueError, match="target"):
        linear_logprobs(hidden, weight, target[:3], group=None, vocab_start=0)


def test_tensor_parallel_two_ranks_over_gloo(tmp_path):
    """TP = 2 (rank 1's shard ends in padding ids) against the single-process oracle on the full head."""
    launch_local([WORKER, str(tmp_path)], 2, timeout=240)
    hidden, weight, target, g_lp, g_h = inputs(seed=3)
    want = oracle(hidden, weight, target, vocab_size=45, temperature=0.8, grads=(g_lp, g_h))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for got in ranks:  # every rank holds the full per-token results and d_hidden
        assert rel(got["logp"], want[0]) <= 1e-6
        assert rel(got["entropy"], want[1]) <= 1e-5
        assert rel(got["d_hidden"], want[2]) <= 1e-6
    assert rel(torch.cat([r["d_weight"] for r in ranks]), want[3]) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
def test_triton_matches_torch_path():
    """On CUDA the Triton kernels against this module's torch path (the CPU path), bf16 and fp32."""
    import sparserl_mcore.loss.fused_logprob as fl

    if not fl._use_triton(torch.zeros(1, device="cuda")):
        pytest.skip("triton is not importable")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        hidden, weight, target, g_lp, g_h = (t.cuda() for t in inputs(n=300, h=64, padded=4096, seed=4))
        target = target * 90  # spread over the vocabulary, below 4050
        results = []
        for triton in (True, False):
            fl._use_triton, saved = (lambda h, t=triton: t), fl._use_triton
            try:
                h = hidden.to(dtype).requires_grad_(True)
                w = weight.to(dtype).requires_grad_(True)
                logp, ent = fl.linear_logprobs(
                    h,
                    w,
                    target,
                    group=None,
                    vocab_start=0,
                    vocab_size=4050,
                    temperature=0.8,
                    chunk_bytes=1 << 18,
                )
                ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
                results.append((logp, ent, h.grad.float(), w.grad.float()))
            finally:
                fl._use_triton = saved
        for got, want in zip(*results, strict=True):
            assert rel(got, want) <= tol
