"""Per-position scores the policies rank cached KV by (pure tensor math, fp32).

Shape legend: Hk = KV heads, Hq = query heads (Hq = Hk * G for grouped-query attention),
n = cached positions, w = observation-window queries, d = head dim.
The window queries are the last w positions of the sequence: query i sits at position n - w + i
and, causally, sees keys 0 .. n - w + i.

Cost: the engine calls these with layers and requests stacked along the head axis, on small
tensors, once per compression; op count matters as much as flops. So every head's G * w queries
go through one batched matmul against its own keys (no repeat of the keys per query head) that
also applies the scale and the causal mask, and redundancy zeroes the diagonal in place.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def window_attention(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the window queries over all keys: [Hq, w, n] fp32.

    keys [Hk, n, d] are shared by the G query heads of their group (head h uses KV head h // G).
    """
    return _grouped_window_attention(keys, queries).flatten(0, 1)


def attention_mass(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Attention each key received, summed over the window queries, max over a GQA group: [Hk, n].

    The unit H2O accumulates: an engine adds it per decode step (w = 1, exact H2O) or per
    compression over the window (cheaper), and gathers it with the kept indices after compressing.
    """
    return _grouped_window_attention(keys, queries).sum(dim=2).amax(dim=1)


def importance(keys: torch.Tensor, queries: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """SnapKV importance: window attention, mean over the window, max over the GQA group,
    then a 1-D max-pool so neighbours of a salient position survive with it: [Hk, n]."""
    probs = _grouped_window_attention(keys, queries).mean(dim=2).amax(dim=1)
    return max_pool(probs, kernel_size)


# fp32 elements of one similarity tile in `redundancy` (32 MiB): the whole [Hk, n, n] matrix of a
# long prompt would not fit (28 layers x 4 heads at 8k positions: 30 GB)
SIMILARITY_TILE_ELEMENTS = 8 * 2**20


def redundancy(
    keys: torch.Tensor, threshold: float, *, tile_elements: int = SIMILARITY_TILE_ELEMENTS
) -> torch.Tensor:
    """R-KV redundancy of each key within its head: [Hk, n], a distribution over positions.

    Cosine similarity between keys with the diagonal zeroed and similarities not above `threshold`
    zeroed (only near-duplicates count), averaged over the other keys, then softmax over positions.
    A key repeated many times scores high, a unique one low.

    The similarity is built a tile of rows (and heads) at a time, at most `tile_elements` fp32
    values, and summed per column: memory O(Hk * n) besides one tile, whatever the prompt length.
    The tile shape depends on n only (not on how many heads are stacked), so a head scores the
    same alone or batched with others.
    """
    unit = F.normalize(keys.float(), dim=-1)
    kv_heads, n, _ = unit.shape
    rows = max(1, min(n, tile_elements // n))
    heads = max(1, tile_elements // (rows * n))
    near = unit.new_zeros(kv_heads, n)  # per key: summed similarity of its near-duplicates
    for h in range(0, kv_heads, heads):
        block = unit[h : h + heads]
        for r in range(0, n, rows):
            sim = block[:, r : r + rows] @ block.transpose(1, 2)  # [heads, rows, n]
            sim.diagonal(offset=r, dim1=1, dim2=2).zero_()  # entries (i, r + i): a key with itself
            near[h : h + heads] += torch.threshold_(sim, threshold, 0.0).sum(dim=1)
    return (near / n).softmax(dim=-1)


def max_pool(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Stride-1 max over a centred window of odd `kernel_size` along positions; shape kept."""
    if kernel_size == 1:
        return scores
    return F.max_pool1d(scores.unsqueeze(1), kernel_size, stride=1, padding=kernel_size // 2).squeeze(1)


def _grouped_window_attention(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """`window_attention` as [Hk, G, w, n]: the G * w queries of a group in one batched matmul."""
    kv_heads, n, d = keys.shape
    q_heads, w, _ = queries.shape
    group = q_heads // kv_heads
    q = queries.float().reshape(kv_heads, group * w, d)  # query heads of a group are contiguous
    bias = _causal_bias(w, n, group, keys.device)
    logits = torch.baddbmm(bias, q, keys.float().transpose(1, 2), alpha=1.0 / math.sqrt(d))
    return logits.view(kv_heads, group, w, n).softmax(dim=-1)


@functools.lru_cache(maxsize=32)
def _causal_bias(w: int, n: int, group: int, device: torch.device) -> torch.Tensor:
    """Additive mask [G * w, n]: query i (position n - w + i) must not see the keys after it.
    Cached: an engine compresses at the same few (window, length) shapes over and over, and
    building it costs more ops than the scoring matmul on small inputs. Never modified in place."""
    bias = torch.zeros(w, n, device=device)
    bias[:, n - w :].masked_fill_(torch.ones(w, w, dtype=torch.bool, device=device).triu(1), -math.inf)
    return bias.repeat(group, 1)
