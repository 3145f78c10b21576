"""The native paged decode kernel (csrc/paged_decode.c via rollout/engine/native.py) against a float64
reference on scattered pages, and its fallbacks: SPARSERL_NATIVE=0 and a compiler that fails both
leave `decode_attention` on the torch path with the same results."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch

from sparserl_mcore.rollout.engine import native
from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention

PAGE = 16
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler (cc / gcc) on this machine: the native kernel cannot be built, torch path only",
)


@pytest.fixture
def fresh_kernel(monkeypatch):
    """Forget the process-wide loaded kernel before and after, so env changes take effect; the
    kernel enabled whatever the caller's environment says (tests may disable it again)."""
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    native.paged_decode.cache_clear()
    yield
    native.paged_decode.cache_clear()


def _case(kv_heads: int, q_heads: int, d: int, lengths: list[int], pool_pages: int = 64):
    """Random K/V in a pool, each request's pages drawn at random from it (scattered, unordered)."""
    g = torch.Generator().manual_seed(kv_heads * 100 + d)
    k_rows, v_rows = (torch.randn(pool_pages, PAGE * kv_heads * d, generator=g) for _ in range(2))
    perm, tables, at = torch.randperm(pool_pages, generator=g).tolist(), [], 0
    for n in lengths:
        tables.append(perm[at : at + -(-n // PAGE)])
        at += len(tables[-1])
    q = torch.randn(len(lengths), q_heads, d, generator=g)
    layout = DecodeLayout.build(tables, lengths, page_size=PAGE, dtype=torch.float32, device="cpu")
    return q, k_rows, v_rows, tables, layout


def _reference(q, k_rows, v_rows, tables, lengths, kv_heads) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax attention per request and query head over its first n entries, and the
    mass each entry got (max over the query heads of its KV head) [B, Hk, P * PAGE], 0 past n."""
    B, Hq, d = q.shape
    out = torch.empty(B, Hq, d, dtype=torch.float64)
    mass = torch.zeros(B, kv_heads, max(len(t) for t in tables) * PAGE, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k = k_rows[table].view(-1, kv_heads, d)[:n].double()
        v = v_rows[table].view(-1, kv_heads, d)[:n].double()
        for h in range(Hq):
            kv = h // (Hq // kv_heads)
            probs = (k[:, kv] @ q[b, h].double() / math.sqrt(d)).softmax(0)
            out[b, h] = probs @ v[:, kv]
            mass[b, kv, :n] = torch.maximum(mass[b, kv, :n], probs)
    return out, mass


@needs_cc
@pytest.mark.parametrize(
    ("kv_heads", "q_heads", "d"),
    [(2, 2, 32), (2, 8, 32), (1, 4, 64), (2, 8, 24)],  # g = 1 and 4; d = 24 takes the generic loop
)
def test_kernel_matches_float64_reference_on_scattered_pages(kv_heads, q_heads, d, fresh_kernel):
    kernel = native.paged_decode()
    assert kernel is not None, "a C compiler is present but the kernel did not build (see the log)"
    lengths = [1, 7, 16, 17, 160]
    q, k_rows, v_rows, tables, layout = _case(kv_heads, q_heads, d, lengths)
    kw = {"kv_heads": kv_heads, "page_size": PAGE}
    out, none = kernel(q, k_rows, v_rows, layout.pages, layout.lengths, **kw)
    ref, ref_mass = _reference(q, k_rows, v_rows, tables, lengths, kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert none is None
    out_m, mass = kernel(q, k_rows, v_rows, layout.pages, layout.lengths, want_mass=True, **kw)
    torch.testing.assert_close(out_m, out, atol=0, rtol=0)
    torch.testing.assert_close(mass.double(), ref_mass, atol=1e-6, rtol=1e-5)
    # decode_attention dispatches to it on CPU fp32, with the mass (H2O) and without
    torch.testing.assert_close(decode_attention(q, k_rows, v_rows, layout)[0], out, atol=0, rtol=0)
    torch.testing.assert_close(
        decode_attention(q, k_rows, v_rows, layout, want_mass=True)[1], mass, atol=0, rtol=0
    )


@needs_cc
def test_kernel_rejects_bad_lengths_and_dtypes(fresh_kernel):
    kernel = native.paged_decode()
    q, k_rows, v_rows, _, layout = _case(2, 8, 32, [5, 20])
    kw = dict(kv_heads=2, page_size=PAGE)
    with pytest.raises(ValueError, match="beyond its page table"):
        kernel(q, k_rows, v_rows, layout.pages, torch.tensor([5, 33]), **kw)
    with pytest.raises(ValueError, match="float32"):
        kernel(q.double(), k_rows, v_rows, layout.pages, layout.lengths, **kw)
    with pytest.raises(ValueError, match="shapes do not agree"):
        kernel(q, k_rows, v_rows, layout.pages, layout.lengths, kv_heads=4, page_size=PAGE)


def test_disabled_by_env_var_falls_back_to_torch(monkeypatch, fresh_kernel):
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert native.paged_decode() is None
    lengths = [1, 17, 160]
    q, k_rows, v_rows, tables, layout = _case(2, 8, 32, lengths)
    out, mass = decode_attention(q, k_rows, v_rows, layout, want_mass=True)
    ref, ref_mass = _reference(q, k_rows, v_rows, tables, lengths, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), ref_mass, atol=1e-6, rtol=1e-5)


def test_failed_build_logs_and_falls_back(monkeypatch, tmp_path, caplog, fresh_kernel):
    """A compiler that answers --version but fails every compile (a real subprocess)."""
    cc = tmp_path / "broken-cc"
    cc.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo broken-cc 1.0 && exit 0\necho "no can do" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.paged_decode() is None
    assert "torch path" in caplog.text and "no can do" in caplog.text
    assert not list(tmp_path.rglob("*.so")), "a failed build must leave nothing in the cache"


@needs_cc
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native._build(native.SOURCE)
    stamp = first.stat().st_mtime_ns
    assert native._build(native.SOURCE) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left behind
