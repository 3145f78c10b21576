"""Decode attention over page tables against a per-request dense reference: the fused path, the
per-KV-head mass loop and the cross-head mass path give the same outputs, and the mass is the
H2O unit (probability each cached key received, max over the query heads of its GQA group)."""

from __future__ import annotations

import math

import pytest
import torch

from sparserl_mcore.rollout.paged_attention import DecodeLayout, decode_attention

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
