"""Per-token log-prob and entropy from tensor-parallel vocabulary shards, never gathering the vocab.

Each TP rank holds logits for a contiguous slice [vocab_start, vocab_start + v_local) of the padded
vocabulary. Per token we need three numbers that are reductions over the whole vocabulary:
  max over v of z_v                          -> all-reduce MAX
  sum exp(z_v - max), sum exp(z_v - max) z_v, z_target (0 on the ranks not owning it)
                                             -> one all-reduce SUM of the three stacked
with z = logits / temperature. Then
  logp = z_target - max - log S,   entropy = max + log S - E_p[z].
Gradients are local to each shard (every global quantity is a per-token scalar saved from the
forward pass): d logp / d z_v = onehot_v - p_v and d H / d z_v = -p_v (z_v - E_p[z]).
Work is chunked over tokens and done in place, so at most two fp32 [chunk, v_local] temporaries
live at once (the backward recomputes the softmax per chunk instead of saving it).

Temperature convention (shared with the rollout engine): log softmax(logits / T) evaluated at the
sampled token, BEFORE any top-p / top-k filtering; vocabulary ids >= `vocab_size` (Megatron's
padding rows, absent from the HF model the sampler runs) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# Default chunk: as many tokens as keep one fp32 [chunk, V/TP] temporary at 2^24 elements (64 MiB);
# a chunk needs two such temporaries in the forward and two in the backward.
CHUNK_ELEMENTS = 1 << 24
# Padding ids get this (finite) logit: exp() of it is 0 and 0 * it is 0, where -inf would give nan.
_PAD_LOGIT = -1e30


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _pad_columns(v_local: int, vocab_start: int, vocab_size: int | None, device) -> Tensor | None:
    """Bool [v_local] marking this shard's padding ids, or None when it has none."""
    if vocab_size is None or vocab_start + v_local <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + v_local, device=device) >= vocab_size


def _shifted_logits(chunk: Tensor, temperature: float, pad: Tensor | None, shift: Tensor | None) -> Tensor:
    """A fresh fp32 copy z = logits / T (padding ids at _PAD_LOGIT), minus `shift` per row if given."""
    z = chunk.to(torch.float32, copy=True).div_(temperature)
    if pad is not None:
        z.masked_fill_(pad, _PAD_LOGIT)
    if shift is not None:
        z.sub_(shift[:, None])
    return z


def _owned_targets(target: Tensor, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    local = target - vocab_start
    owned = (local >= 0) & (local < v_local)
    return local.clamp(0, v_local - 1), owned


class _VocabParallelLogProb(torch.autograd.Function):
    """Saved per token: the global max m, log S = log sum exp(z - m) and E_p[z] - m."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, temperature, chunk_tokens):
        v_local = logits.shape[-1]
        flat, tgt = logits.reshape(-1, v_local), target.reshape(-1)
        n = flat.shape[0]
        pad = _pad_columns(v_local, vocab_start, vocab_size, logits.device)
        stats = torch.empty(3, n, dtype=torch.float32, device=logits.device)  # m, log S, E[z] - m
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, chunk_tokens):
            hi = min(lo + chunk_tokens, n)
            z = _shifted_logits(flat[lo:hi], temperature, pad, None)
            m = z.amax(dim=-1)
            if _group_size(group) > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local_t, owned = _owned_targets(tgt[lo:hi], vocab_start, v_local)
            z_t = z.gather(1, local_t[:, None]).squeeze(1)
            z.sub_(m[:, None])
            e = torch.exp(z)
            sums = torch.stack([e.sum(dim=-1), torch.einsum("ij,ij->i", e, z), torch.where(owned, z_t, 0.0)])
            del e, z
            if _group_size(group) > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            log_s = sums[0].log()
            stats[0, lo:hi], stats[1, lo:hi], stats[2, lo:hi] = m, log_s, sums[1] / sums[0]
            logp[lo:hi] = sums[2] - m - log_s
        ctx.save_for_backward(logits, target, stats)
        ctx.set_materialize_grads(False)  # an unused output (e.g. a detached entropy) gets None, not zeros
        ctx.params = (vocab_start, vocab_size, temperature, chunk_tokens)
        entropy = stats[1] - stats[2]  # H = m + log S - E[z]
        return logp.view(target.shape), entropy.view(target.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, target, stats = ctx.saved_tensors
        vocab_start, vocab_size, temperature, chunk_tokens = ctx.params
        v_local = logits.shape[-1]
        flat, tgt = logits.reshape(-1, v_local), target.reshape(-1)
        pad = _pad_columns(v_local, vocab_start, vocab_size, logits.device)
        g_lp = grad_logp.reshape(-1).float() if grad_logp is not None else None
        g_h = grad_ent.reshape(-1).float() if grad_ent is not None else None
        grad = torch.empty_like(flat)
        for lo in range(0, flat.shape[0], chunk_tokens):
            hi = min(lo + chunk_tokens, flat.shape[0])
            z = _shifted_logits(flat[lo:hi], temperature, pad, stats[0, lo:hi])
            p = (z - stats[1, lo:hi, None]).exp_()
            # dlogp/dz = onehot - p and dH/dz = -p (z - E[z]): g = onehot*g_lp - p*(g_lp + g_h*(z - E[z]))
            if g_h is not None:
                z.sub_(stats[2, lo:hi, None]).mul_(g_h[lo:hi, None])
            else:
                z.zero_()
            if g_lp is not None:
                z.add_(g_lp[lo:hi, None])
            z.mul_(p).neg_()
            del p
            if g_lp is not None:  # the target term; adding 0 elsewhere: no nonzero (a host sync)
                local_t, owned = _owned_targets(tgt[lo:hi], vocab_start, v_local)
                z.scatter_add_(1, local_t[:, None], torch.where(owned, g_lp[lo:hi], 0.0)[:, None])
            if pad is not None:
                z.masked_fill_(pad, 0.0)
            grad[lo:hi] = z.div_(temperature)
        return grad.view_as(logits), None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of `target` and the softmax entropy per token, from this rank's vocab shard.

    Args:
        logits: [..., v_local] this TP rank's slice of the (padded) vocabulary, any float dtype.
        target: [...] global token ids (int64); positions outside the loss mask may hold any id
            in [0, padded vocab).
        group: the tensor-parallel group (None or size 1: the shard is the whole vocabulary).
        vocab_start: global id of this shard's first column (tp_rank * v_local in Megatron).
        vocab_size: the real vocabulary; ids at or beyond it are padding and excluded.
        temperature: the sampler's temperature (logits / T, see module docstring).
        chunk_tokens: tokens per chunk, bounding fp32 temporaries to [chunk_tokens, v_local];
            None: CHUNK_ELEMENTS // v_local.

    Returns:
        (logp, entropy), float32, shape of `target`; both differentiable w.r.t. `logits`.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy has no log-probs)")
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be > 0")
    return _VocabParallelLogProb.apply(
        logits, target.long(), group, vocab_start, vocab_size, temperature, chunk_tokens
    )
