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
Work is chunked over tokens so fp32 temporaries stay [chunk, v_local].

Temperature convention (shared with the rollout engine): log softmax(logits / T) evaluated at the
sampled token, BEFORE any top-p / top-k filtering; vocabulary ids >= `vocab_size` (Megatron's
padding rows, absent from the HF model the sampler runs) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 1024


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _shard_logits(chunk: Tensor, temperature: float, vocab_start: int, vocab_size: int | None) -> Tensor:
    """fp32 z = logits / T of one chunk, padding ids set to -inf."""
    z = chunk.float() / temperature
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        pad = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))
    return z


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, temperature, chunk_tokens):
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        tgt = target.reshape(-1)
        n = flat.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty_like(logp)
        maxes, log_sums, mean_z = torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp)
        for lo in range(0, n, chunk_tokens):
            hi = min(lo + chunk_tokens, n)
            z = _shard_logits(flat[lo:hi], temperature, vocab_start, vocab_size)
            m = z.max(dim=-1).values
            if _group_size(group) > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(z - m[:, None])
            local_t = tgt[lo:hi] - vocab_start
            owned = (local_t >= 0) & (local_t < v_local)
            z_t = z.gather(1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(1)
            sums = torch.stack(
                [
                    e.sum(dim=-1),
                    torch.where(e > 0, e * z, 0.0).sum(dim=-1),  # exp(-inf) * -inf would be nan
                    torch.where(owned, z_t, 0.0),
                ]
            )
            if _group_size(group) > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            log_s = sums[0].log()
            ez = sums[1] / sums[0]
            logp[lo:hi] = sums[2] - m - log_s
            ent[lo:hi] = m + log_s - ez
            maxes[lo:hi], log_sums[lo:hi], mean_z[lo:hi] = m, log_s, ez
        ctx.save_for_backward(logits, target, maxes, log_sums, mean_z)
        ctx.params = (vocab_start, vocab_size, temperature, chunk_tokens)
        return logp.view(target.shape), ent.view(target.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, target, maxes, log_sums, mean_z = ctx.saved_tensors
        vocab_start, vocab_size, temperature, chunk_tokens = ctx.params
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        tgt = target.reshape(-1)
        g_lp = grad_logp.reshape(-1).float() if grad_logp is not None else None
        g_h = grad_ent.reshape(-1).float() if grad_ent is not None else None
        grad = torch.empty_like(flat)
        for lo in range(0, flat.shape[0], chunk_tokens):
            hi = min(lo + chunk_tokens, flat.shape[0])
            z = _shard_logits(flat[lo:hi], temperature, vocab_start, vocab_size)
            p = torch.exp(z - (maxes[lo:hi] + log_sums[lo:hi])[:, None])
            g = torch.zeros_like(z)
            if g_h is not None:  # dH/dz = -p (z - E[z]); p = 0 on padding ids
                centered = torch.where(p > 0, z - mean_z[lo:hi, None], 0.0)
                g -= g_h[lo:hi, None] * p * centered
            if g_lp is not None:  # dlogp/dz = onehot - p
                g -= g_lp[lo:hi, None] * p
                local_t = tgt[lo:hi] - vocab_start
                owned = (local_t >= 0) & (local_t < v_local)
                rows = torch.nonzero(owned).squeeze(1)
                g[rows, local_t[rows]] += g_lp[lo:hi][rows]
            grad[lo:hi] = (g / temperature).to(grad.dtype)
        return grad.view_as(logits), None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
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
        chunk_tokens: tokens per chunk; bounds fp32 temporaries to [chunk_tokens, v_local].

    Returns:
        (logp, entropy), float32, shape of `target`; both differentiable w.r.t. `logits`.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy has no log-probs)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be > 0")
    return _VocabParallelLogProb.apply(
        logits, target.long(), group, vocab_start, vocab_size, temperature, chunk_tokens
    )
