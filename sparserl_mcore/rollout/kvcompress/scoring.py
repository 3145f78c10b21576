"""Per-position scores the policies rank cached KV by (pure tensor math, fp32).

Shape legend: Hk = KV heads, Hq = query heads (Hq = Hk * G for grouped-query attention),
n = cached positions, w = observation-window queries, d = head dim.
The window queries are the last w positions of the sequence: query i sits at position n - w + i
and, causally, sees keys 0 .. n - w + i.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def window_attention(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the window queries over all keys: [Hq, w, n] fp32.

    keys [Hk, n, d] are shared by the G query heads of their group (head h uses KV head h // G).
    """
    kv_heads, n, d = keys.shape
    q_heads, w, _ = queries.shape
    group = q_heads // kv_heads
    keys_q = keys.float().repeat_interleave(group, dim=0)  # [Hq, n, d]
    logits = queries.float() @ keys_q.transpose(1, 2) / math.sqrt(d)  # [Hq, w, n]
    query_pos = torch.arange(n - w, n, device=keys.device).unsqueeze(1)  # [w, 1]
    future = torch.arange(n, device=keys.device).unsqueeze(0) > query_pos  # [w, n]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


def attention_mass(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Attention each key received, summed over the window queries, max over a GQA group: [Hk, n].

    The unit H2O accumulates: an engine adds it per decode step (w = 1, exact H2O) or per
    compression over the window (cheaper), and gathers it with the kept indices after compressing.
    """
    probs = window_attention(keys, queries).sum(dim=1)  # [Hq, n]
    return _max_over_group(probs, keys.shape[0])


def importance(keys: torch.Tensor, queries: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """SnapKV importance: window attention, mean over the window, max over the GQA group,
    then a 1-D max-pool so neighbours of a salient position survive with it: [Hk, n]."""
    probs = window_attention(keys, queries).mean(dim=1)  # [Hq, n]
    return max_pool(_max_over_group(probs, keys.shape[0]), kernel_size)


def redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV redundancy of each key within its head: [Hk, n], a distribution over positions.

    Cosine similarity between keys with the diagonal zeroed and similarities not above `threshold`
    zeroed (only near-duplicates count), averaged over the other keys, then softmax over positions.
    A key repeated many times scores high, a unique one low.
    """
    unit = F.normalize(keys.float(), dim=-1)
    sim = unit @ unit.transpose(1, 2)  # [Hk, n, n]
    n = keys.shape[1]
    sim = sim.masked_fill(torch.eye(n, dtype=torch.bool, device=keys.device), 0.0)
    sim = torch.where(sim > threshold, sim, torch.zeros_like(sim))
    return sim.mean(dim=1).softmax(dim=-1)


def max_pool(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Stride-1 max over a centred window of odd `kernel_size` along positions; shape kept."""
    if kernel_size == 1:
        return scores
    return F.max_pool1d(scores.unsqueeze(1), kernel_size, stride=1, padding=kernel_size // 2).squeeze(1)


def _max_over_group(per_q_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    q_heads, n = per_q_head.shape
    return per_q_head.view(kv_heads, q_heads // kv_heads, n).amax(dim=1)
