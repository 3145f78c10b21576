"""Attention over page tables, gather based (plain torch ops, so the same code runs on CPU and CUDA).

Each request's cached K/V are addressed by its page table (decode) or flat slot ids
(`KVPool.slot_table`, prefill); a call gathers what it needs, computes softmax attention (fp32
softmax / accumulation) and can also return the attention mass each key received (max over the
query heads of a GQA group, summed over queries), which H2O accumulates.

Shape legend: B requests, t new tokens, N / n cached entries, Hq query heads, Hk KV heads, g = Hq/Hk,
d head dim, S pool slots.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparserl_mcore.rollout.engine import native, triton_decode
from sparserl_mcore.rollout.engine.host_ints import long_tensor

# The cross-head mass path (`_cross_head_attention`) costs Hk times the score flops: it pays off
# while op count dominates, i.e. few KV heads (Qwen2.5-0.5B/1.5B and the bench model have 2).
CROSS_HEAD_MAX_KV_HEADS = 2


@dataclass(frozen=True)
class DecodeLayout:
    """Where each decoding request's cache lives, built once per step and shared by every layer.

    pages [B * P]: each request's page table padded to P pages with any valid page, request-major;
    lengths [B] int64: entries in use per request (what the native kernel reads); valid [B, N = P *
    page_size]: the same as a mask; bias [B, 1, 1, N]: the same as an additive mask (0 / -inf, in
    the pool's dtype), the form the fused SDPA takes without converting per call.
    cross_bias [B, Hq, N * Hk] fp32 (only when built with `cross_heads`): the mask of the cross-head
    mass path (`decode_attention`), -inf also where a key belongs to another KV head than the query.
    """

    pages: torch.Tensor
    lengths: torch.Tensor
    page_size: int
    valid: torch.Tensor
    bias: torch.Tensor
    cross_bias: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        lengths: list[int],
        *,
        page_size: int,
        dtype: torch.dtype,
        device,
        cross_heads: tuple[int, int] | None = None,
    ) -> DecodeLayout:
        """tables: each request's pages (at least ceil(length / page_size)); lengths: entries in use;
        cross_heads: (Hq, Hk) to also build `cross_bias` (mass wanted and Hk <= CROSS_HEAD_MAX_KV_HEADS)."""
        width = max(len(t) for t in tables)
        # page tables and lengths as ONE tensor from Python ints; the mask in two ops (a compare with
        # a cached arange, a `where` straight to the additive form): built every step
        flat, device = [p for t in tables for p in (*t, *[0] * (width - len(t)))], torch.device(device)
        both = long_tensor(flat + lengths, device)
        pages, lengths_t = both[: len(flat)], both[len(flat) :]
        valid = _entry_index(width * page_size, device) < lengths_t[:, None]
        bias = torch.where(valid, 0.0, -math.inf)
        if bias.dtype != dtype:
            bias = bias.to(dtype)
        cross = None
        if cross_heads is not None:
            # [B, 1, N * Hk] + [Hq, N * Hk]: a broadcast over long contiguous rows, not
            # [B, 1, N, 1] + [Hq, 1, Hk], whose inner loop would run over only Hk elements
            entries = bias.float().repeat_interleave(cross_heads[1], dim=1)[:, None, :]
            cross = entries + _other_head_bias(*cross_heads, valid.shape[1], device)
        return cls(
            pages=pages,
            lengths=lengths_t,
            page_size=page_size,
            valid=valid,
            bias=bias[:, None, None, :],
            cross_bias=cross,
        )


@functools.lru_cache(maxsize=64)
def _entry_index(n: int, device: torch.device) -> torch.Tensor:
    """[1, n] entry positions 0..n-1 (cached per padded width; never modified in place)."""
    return torch.arange(n, device=device)[None, :]


@functools.lru_cache(maxsize=64)
def _other_head_bias(q_heads: int, kv_heads: int, n: int, device: torch.device) -> torch.Tensor:
    """[Hq, n * Hk]: -inf where entry j * Hk + h holds KV head h other than query head i's (i // g),
    else 0. Cached (a step has one of a few padded widths n): building it costs more ops than
    using it. Never modified in place."""
    own = torch.arange(q_heads, device=device)[:, None] // (q_heads // kv_heads)
    other = (own != torch.arange(kv_heads, device=device)).repeat(1, n)
    return torch.zeros(q_heads, n * kv_heads, device=device).masked_fill_(other, -math.inf)


def native_decode_kernel(device: torch.device, dtype: torch.dtype) -> native.PagedDecode | None:
    """The native kernel `decode_attention` runs for a pool on `device` in `dtype` (CPU fp32, kernel
    built), else None; when it runs, the torch path's layout extras (`cross_bias`) go unused."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return native.paged_decode()


def decode_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    layout: DecodeLayout,
    *,
    want_mass: bool = False,
    use_native: bool = True,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per request over its own cache, gathered page by page.

    q [B, Hq, d]; k_rows / v_rows [pages, page_size * Hk * d] (one layer of the pool, a row per
    page). Gathering whole pages (contiguous blocks, `index_select` over rows) makes the copy a few
    large memcpys instead of per-entry indexing. Returns out [B, Hq, d] (q's dtype) and optionally
    mass [B, Hk, N].
    On CPU in fp32 the native kernel (`native.paged_decode`, with or without the mass) reads the
    pages in place instead, no gather (docs/rollout.md, "Step cost"); without it, or with `use_native=False`
    (benchmarks comparing the two), the torch path below.
    With `use_triton` (the engine's `triton_decode`) and no mass wanted, the Triton kernel
    (`triton_decode.paged_decode`) reads the pages in place on CUDA; this gather path is its fallback.
    """
    if use_triton and not want_mass and triton_decode.usable(q):
        return triton_decode.paged_decode(
            q, k_rows, v_rows, layout.pages, layout.lengths, page_size=layout.page_size
        ), None
    B, Hq, d = q.shape
    N = layout.valid.shape[1]
    kernel = native_decode_kernel(q.device, q.dtype) if use_native and q.dtype == k_rows.dtype else None
    if kernel is not None:
        return kernel(
            q.contiguous(),
            k_rows,
            v_rows,
            layout.pages,
            layout.lengths,
            kv_heads=k_rows.shape[1] // (layout.page_size * d),
            page_size=layout.page_size,
            want_mass=want_mass,
        )
    k = k_rows.index_select(0, layout.pages).view(B, -1, d)  # [B, N * Hk, d], entry-major
    v = v_rows.index_select(0, layout.pages).view(B, -1, d)
    if want_mass and layout.cross_bias is not None:
        return _cross_head_attention(q, k, v, layout.cross_bias, entries=N)
    k, v = (x.view(B, N, -1, d).transpose(1, 2) for x in (k, v))  # [B, Hk, N, d]
    Hk = k.shape[1]
    qg = q.view(B, Hk, Hq // Hk, d)  # the g query heads of a KV head act as g query rows
    if not want_mass:  # fused kernel, fp32 accumulation
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=layout.bias).reshape(B, Hq, d), None
    # One KV head at a time: head h's keys k[:, h] are a strided [B, N, d] view that bmm reads in
    # place, while the batched [B, Hk] matmul would first copy K and V head-major (docs/rollout.md,
    # "Compression cost").
    qs = qg.float() / math.sqrt(d)
    bias = layout.bias[:, 0].float()  # [B, 1, N]
    outs, masses = [], []
    for h in range(Hk):
        probs = torch.baddbmm(bias, qs[:, h], k[:, h].float().transpose(1, 2)).softmax(-1)  # [B, g, N]
        outs.append(torch.bmm(probs, v[:, h].float()))
        masses.append(probs.amax(1))
    return torch.stack(outs, 1).view(B, Hq, d).to(q.dtype), torch.stack(masses, 1)


def _cross_head_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cross_bias: torch.Tensor, entries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` with the mass, in five ops: every query scores the keys of ALL KV heads
    in the gathered [B, N * Hk, d] order (one bmm, no head-major copy), `cross_bias` drops the other
    heads' keys to exactly 0 probability, so one softmax is each head's own softmax and one bmm with
    the values gives the output. Hk times the flops of the per-head loop, which on CPU at decode
    sizes costs less than the loop's extra ops for Hk <= 2 (docs/rollout.md, "Compression cost").
    k, v: the gathered pages [B, N * Hk, d] (entry-major, the pool's order); cross_bias and
    entries (N): the layout's."""
    B, Hq, d = q.shape
    N = entries
    Hk = cross_bias.shape[2] // N
    scores = torch.baddbmm(cross_bias, q.float(), k.float().transpose(1, 2), alpha=1 / math.sqrt(d))
    probs = scores.softmax(-1)
    out = torch.bmm(probs, v.float()).to(q.dtype)
    # [B, Hk (query group), g, N, Hk (key head)] -> max over the group, own head's keys: [B, Hk, N]
    mass = probs.view(B, Hk, Hq // Hk, N, Hk).amax(2).diagonal(dim1=1, dim2=3).transpose(1, 2)
    return out, mass


def prefill_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    *,
    want_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of t new tokens, the last t of the request's n cached entries.

    q [t, Hq, d]; slots [n] (n >= t, K/V of the new tokens already written). Returns out [t, Hq, d]
    and optionally mass [Hk, n] (per query max over the group, summed over the t queries).
    Without the mass it runs the fused SDPA, which never materialises the [Hq, t, n] scores: 2x
    faster than the explicit path below at a 32-token prompt, 5x at 512 and 10x at 1024 tokens
    (CPU, one thread, micro-benchmark 2026-11-21); the mass needs the probabilities, so H2O keeps
    the explicit path.
    """
    t, Hq, d = q.shape
    n, Hk = slots.shape[0], k_flat.shape[1]
    if not want_mass:
        return _fused_prefill(q, k_flat.index_select(0, slots), v_flat.index_select(0, slots)), None
    k = k_flat.index_select(0, slots).float().permute(1, 2, 0)  # [Hk, d, n]
    v = v_flat.index_select(0, slots).float().permute(1, 0, 2)  # [Hk, n, d]
    qg = q.float().permute(1, 0, 2).reshape(Hk, Hq // Hk, t, d)
    scores = qg @ k[:, None] / math.sqrt(d)  # [Hk, g, t, n]
    future = torch.arange(n, device=q.device)[None, :] > torch.arange(n - t, n, device=q.device)[:, None]
    probs = scores.masked_fill(future, -math.inf).softmax(-1)
    out = (probs @ v[:, None]).reshape(Hq, t, d).permute(1, 0, 2).to(q.dtype)
    return out, probs.amax(1).sum(1) if want_mass else None


def _fused_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [t, Hq, d] against k, v [n, Hk, d], causal with the queries at the last t positions.

    The g query heads of a KV head are a batch dim of their own over K/V expanded (stride 0, no
    copy) across it, so the causal pattern stays per query row; n == t is SDPA's own `is_causal`
    (top-left aligned), a cached prefix (n > t) needs the bottom-right mask."""
    t, Hq, d = q.shape
    n, Hk = k.shape[0], k.shape[1]
    g = Hq // Hk
    kg, vg = (x.permute(1, 0, 2)[:, None].expand(Hk, g, n, d) for x in (k, v))
    qg = q.view(t, Hk, g, d).permute(1, 2, 0, 3)  # [Hk, g, t, d]
    if n == t:
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    else:
        allowed = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=allowed)
    return out.permute(2, 0, 1, 3).reshape(t, Hq, d)
