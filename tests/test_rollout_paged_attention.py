"""Decode and prefill attention over the pool against per-request dense references. Decode: the
fused path, the per-KV-head mass loop and the cross-head mass path give the same outputs, and the
mass is the H2O unit (probability each cached key received, max over the query heads of its GQA
group). Prefill: the fused path and the explicit mass path, with and without a cached prefix."""

from __future__ import annotations

import math

import pytest
import torch

from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention, prefill_attention

PAGE = 4


def _reference(q, k_rows, v_rows, tables, lengths, kv_heads):
    """Per request: gather its first n entries, plain softmax attention per query head."""
    B, Hq, d = q.shape
    g = Hq // kv_heads
    outs, masses = [], []
    N = max(len(t) for t in tables) * PAGE
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k = k_rows[table].view(-1, kv_heads, d)[:n].double()  # [n, Hk, d]
        v = v_rows[table].view(-1, kv_heads, d)[:n].double()
        probs = torch.stack(
            [(k[:, h // g] @ q[b, h].double()).div(math.sqrt(d)).softmax(0) for h in range(Hq)]
        )
        outs.append(torch.stack([probs[h] @ v[:, h // g] for h in range(Hq)]))
        mass = probs.view(kv_heads, g, n).amax(1)
        masses.append(torch.nn.functional.pad(mass, (0, N - n)))
    return torch.stack(outs), torch.stack(masses)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_attention_paths_match_dense_reference(kv_heads):
    torch.manual_seed(0)
    Hq, d, pages = 8, 16, 12
    k_rows, v_rows = (torch.randn(pages, PAGE * kv_heads * d) for _ in range(2))
    lengths = [5, 12, 1, 9]
    perm = torch.randperm(pages).tolist()
    tables = [perm[0:2], perm[2:5], perm[5:6], perm[6:9]]
    q = torch.randn(len(lengths), Hq, d)
    ref_out, ref_mass = _reference(q, k_rows, v_rows, tables, lengths, kv_heads)
    plain = DecodeLayout.build(tables, lengths, page_size=PAGE, dtype=torch.float32, device="cpu")
    cross = DecodeLayout.build(
        tables, lengths, page_size=PAGE, dtype=torch.float32, device="cpu", cross_heads=(Hq, kv_heads)
    )
    fused, none = decode_attention(q, k_rows, v_rows, plain)
    assert none is None
    torch.testing.assert_close(fused.double(), ref_out, atol=1e-5, rtol=1e-5)
    for layout in (plain, cross):
        out, mass = decode_attention(q, k_rows, v_rows, layout, want_mass=True)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mass.double(), ref_mass, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("kv_heads", "t", "n"), [(2, 7, 7), (2, 3, 10), (1, 5, 5), (4, 1, 9)])
def test_prefill_attention_fused_and_mass_paths_match_dense_reference(kv_heads, t, n):
    """The fused (SDPA) path and the explicit mass path against a float64 per-head reference, for a
    whole prompt (n == t) and a prompt tail after a cached prefix (n > t, bottom-right causal)."""
    torch.manual_seed(1)
    Hq, d, slots_total = 8, 16, 32
    g = Hq // kv_heads
    k_flat, v_flat = (torch.randn(slots_total, kv_heads, d) for _ in range(2))
    slots = torch.randperm(slots_total)[:n]
    q = torch.randn(t, Hq, d)
    k, v = k_flat[slots].double(), v_flat[slots].double()  # [n, Hk, d]
    outs, probs = [], []
    for h in range(Hq):
        scores = q[:, h].double() @ k[:, h // g].T / math.sqrt(d)  # [t, n]
        future = torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None]
        p = scores.masked_fill(future, -math.inf).softmax(-1)
        probs.append(p)
        outs.append(p @ v[:, h // g])
    ref_out = torch.stack(outs, 1)  # [t, Hq, d]
    ref_mass = torch.stack(probs).view(kv_heads, g, t, n).amax(1).sum(1)  # [Hk, n]
    fused, none = prefill_attention(q, k_flat, v_flat, slots)
    assert none is None
    torch.testing.assert_close(fused.double(), ref_out, atol=1e-5, rtol=1e-5)
    out, mass = prefill_attention(q, k_flat, v_flat, slots, want_mass=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), ref_mass, atol=1e-6, rtol=1e-5)
