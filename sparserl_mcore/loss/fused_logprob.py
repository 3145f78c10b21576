"""The LM head fused with the per-token log-prob and entropy: hidden states in, never [tokens, vocab].

`linear_logprobs(hidden [N, H], weight [V/TP, H], target [N])` is the output layer followed by
`vocab_parallel_logprobs` (the test oracle, loss/vocab_parallel.py) in one autograd Function. Per
chunk of tokens it projects z = hidden_c @ W^T, reduces it to the three per-token numbers of the
vocab-parallel algebra (MAX all-reduce, then one SUM all-reduce of sum exp, sum exp * z and the
target logit) and drops it; the backward recomputes z per chunk, turns it in place into dz
(`onehot*g_lp - p*(g_lp + g_h*(z - E[z]))`, divided by T; target term by `scatter_add_`, no
`nonzero`) and folds it straight into d_hidden = dz @ W and dW = dz^T @ hidden. So at most two
[chunk, V/TP] fp32 temporaries live at once and the logits never exist whole, in any dtype.

Callers pass only the rows the loss needs (the response tokens): prompts cost no vocabulary work.

Megatron's output layer, which this replaces on the last stage:
- its input goes through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of
  d_input over TP backward): `reduce_dgrad=True` does that all-reduce here. Under sequence
  parallelism the caller gathers the sequence with megatron's own op, whose backward reduce-scatters
  the partial d_hidden, and passes `reduce_dgrad=False`;
- its weight gradient follows `LinearWithGradAccumulationAndAsyncCommunication`: with
  `gradient_accumulation_fusion` it accumulates into `weight.main_grad` in fp32 and returns a dummy
  (zeros with `zero_out_wgrad`) after setting `grad_added_to_main_grad`, else it returns dW in the
  weight's dtype for DDP's hook to add.

On CUDA with Triton importable, the per-chunk softmax algebra runs as two Triton kernels reading
the GEMM's output in its own dtype (loss/fused_logprob_triton.py); this torch version is the CPU
path, the fallback and the reference they are tested against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from sparserl_mcore.loss.vocab_parallel import _PAD_LOGIT, _group_size, _owned_targets, _pad_columns

# Bytes of one [chunk, V/TP] temporary (fp32 in the torch path): 256 MiB = 441 tokens at V = 151,936.
CHUNK_BYTES = 1 << 28


def _logits(hidden_c: Tensor, weight: Tensor, temperature: float, pad: Tensor | None) -> Tensor:
    """A fresh fp32 [chunk, V/TP] z = hidden_c @ W^T / T, padding ids at _PAD_LOGIT."""
    z = torch.mm(hidden_c, weight.t())
    z = z.float().div_(temperature) if z.dtype != torch.float32 else z.div_(temperature)
    if pad is not None:
        z.masked_fill_(pad, _PAD_LOGIT)
    return z


def _accumulate(acc: Tensor, dz: Tensor, hidden_c: Tensor) -> None:
    """acc (fp32) += dz^T @ hidden_c, the product accumulated in fp32 (cuBLAS out_dtype on CUDA)."""
    if dz.dtype == torch.float32:
        acc.addmm_(dz.t(), hidden_c)
    elif acc.is_cuda:
        torch.addmm(acc, dz.t(), hidden_c, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(dz.t(), hidden_c))


def _dz_torch(z: Tensor, stats: Tensor, g_lp, g_h, local_t, owned, pad, temperature) -> Tensor:
    """z = logits / T of one chunk -> d loss / d logits, in place (see the module docstring)."""
    z.sub_(stats[0, :, None])
    p = (z - stats[1, :, None]).exp_()
    if g_h is not None:
        z.sub_(stats[2, :, None]).mul_(g_h[:, None])
    else:
        z.zero_()
    if g_lp is not None:
        z.add_(g_lp[:, None])
    z.mul_(p).neg_()
    del p
    if g_lp is not None:
        z.scatter_add_(1, local_t[:, None], torch.where(owned, g_lp, 0.0)[:, None])
    if pad is not None:
        z.masked_fill_(pad, 0.0)
    return z.div_(temperature)


def _stats_torch(z: Tensor, group, local_t: Tensor, owned: Tensor) -> tuple[Tensor, Tensor]:
    """(m, [sum exp(z - m), sum exp(z - m) (z - m), z_target]) over the whole vocabulary; z consumed."""
    m = z.amax(dim=-1)
    if _group_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z_t = z.gather(1, local_t[:, None]).squeeze(1)
    z.sub_(m[:, None])
    e = torch.exp(z)
    s0 = e.sum(dim=-1)
    sums = torch.stack([s0, e.mul_(z).sum(dim=-1), torch.where(owned, z_t, 0.0)])
    if _group_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return m, sums


def _valid_columns(v_local: int, vocab_start: int, vocab_size: int | None) -> int:
    """Columns of this shard below `vocab_size` (padding ids are a suffix of the padded vocabulary)."""
    return v_local if vocab_size is None else max(0, min(v_local, vocab_size - vocab_start))


def _use_triton(hidden: Tensor) -> bool:
    if not hidden.is_cuda:
        return False
    from sparserl_mcore.loss import fused_logprob_triton

    return fused_logprob_triton.available()


class _LinearLogProb(torch.autograd.Function):
    """Saved per token: the global max m, log S and E_p[z] - m (3 floats), plus hidden and W."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_start, vocab_size, temperature, chunk, flags):
        reduce_dgrad, fusion, triton = flags
        n, v_local = hidden.shape[0], weight.shape[0]
        pad = _pad_columns(v_local, vocab_start, vocab_size, hidden.device)
        n_valid = _valid_columns(v_local, vocab_start, vocab_size)
        local_t, owned = _owned_targets(target, vocab_start, v_local)
        stats = torch.empty(3, n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            if triton:
                from sparserl_mcore.loss.fused_logprob_triton import chunk_stats

                m, sums = chunk_stats(
                    hidden[lo:hi], weight, group, local_t[lo:hi], owned[lo:hi], temperature, n_valid
                )
            else:
                z = _logits(hidden[lo:hi], weight, temperature, pad)
                m, sums = _stats_torch(z, group, local_t[lo:hi], owned[lo:hi])
                del z
            log_s = sums[0].log()
            stats[0, lo:hi], stats[1, lo:hi], stats[2, lo:hi] = m, log_s, sums[1] / sums[0]
            logp[lo:hi] = sums[2] - m - log_s
        ctx.save_for_backward(hidden, weight, local_t, owned, stats)
        ctx.set_materialize_grads(False)
        ctx.params = (group, vocab_start, vocab_size, temperature, chunk, flags)
        # H = log S - E_p[z - m]: E_p[z - m] = sum e (z - m) / S, stats[2] holds it
        return logp, stats[1] - stats[2]

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, local_t, owned, stats = ctx.saved_tensors
        group, vocab_start, vocab_size, temperature, chunk, (reduce_dgrad, fusion, triton) = ctx.params
        n, v_local = hidden.shape[0], weight.shape[0]
        pad = _pad_columns(v_local, vocab_start, vocab_size, hidden.device)
        n_valid = _valid_columns(v_local, vocab_start, vocab_size)
        g_lp = grad_logp.float() if grad_logp is not None else None
        g_h = grad_ent.float() if grad_ent is not None else None
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fused_wgrad = want_dw and fusion and hasattr(weight, "main_grad")
        d_hidden = torch.zeros_like(hidden) if want_dh else None
        acc = None
        if want_dw:
            acc = (
                weight.main_grad
                if fused_wgrad
                else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            )
        if g_lp is not None or g_h is not None:
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                sl = slice(lo, hi)
                gl = g_lp[sl] if g_lp is not None else None
                gh = g_h[sl] if g_h is not None else None
                if triton:
                    from sparserl_mcore.loss.fused_logprob_triton import chunk_dz

                    dz = chunk_dz(
                        hidden[sl], weight, stats[:, sl], gl, gh, local_t[sl], owned[sl], temperature, n_valid
                    )
                else:
                    z = _logits(hidden[sl], weight, temperature, pad)
                    dz = _dz_torch(z, stats[:, sl], gl, gh, local_t[sl], owned[sl], pad, temperature)
                    dz = dz.to(weight.dtype)
                if d_hidden is not None:
                    torch.mm(dz, weight, out=d_hidden[sl])
                if acc is not None:
                    _accumulate(acc, dz, hidden[sl])
                del dz
        if d_hidden is not None and reduce_dgrad and _group_size(group) > 1:
            dist.all_reduce(d_hidden, group=group)
        grad_w = None
        if fused_wgrad and hasattr(weight, "grad_added_to_main_grad"):
            # megatron's protocol: DDP's hook skips the add; zeros where another use adds a real grad
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            grad_w = make(weight.main_grad.shape, dtype=hidden.dtype, device=hidden.device)
            weight.grad_added_to_main_grad = True
        elif want_dw and not fused_wgrad and acc is not None:
            grad_w = acc.to(weight.dtype)
        return d_hidden, grad_w, None, None, None, None, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    reduce_dgrad: bool = True,
    gradient_accumulation_fusion: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-prob of `target` and the softmax entropy per row of `hidden`, through this rank's head shard.

    Args:
        hidden: [N, H] final hidden states of the rows to score (the loss's rows only).
        weight: [V/TP, H] this TP rank's output-layer (or tied embedding) shard.
        target: [N] global token ids to score, below `vocab_size`.
        group, vocab_start, vocab_size, temperature: as `vocab_parallel_logprobs`.
        chunk_bytes: size of one [chunk, V/TP] temporary; sets the tokens per chunk.
        reduce_dgrad: all-reduce d_hidden over `group` (False when the caller's sequence-parallel
            gather reduce-scatters it).
        gradient_accumulation_fusion: the model config's flag; dW then goes into `weight.main_grad`.

    Returns:
        (logp, entropy), float32 [N]; differentiable w.r.t. `hidden` and `weight`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target {tuple(target.shape)} must be [N] for hidden {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy has no log-probs)")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be > 0")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
    triton = _use_triton(hidden)
    elem = hidden.element_size() if triton else 4  # the Triton path's temporary is the GEMM output
    chunk = max(1, chunk_bytes // (elem * weight.shape[0]))
    flags = (reduce_dgrad, gradient_accumulation_fusion, triton)
    return _LinearLogProb.apply(
        hidden.to(weight.dtype),
        weight,
        target.long(),
        group,
        vocab_start,
        vocab_size,
        temperature,
        chunk,
        flags,
    )
