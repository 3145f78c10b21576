"""Paged decode attention as a Triton kernel that reads each request's K/V pages in place (CUDA).

Why: the gather path (`paged_attention.decode_attention`) copies every request's pages, up to the
step's padded width, into a contiguous tensor that SDPA then reads again; in a CUDA graph that width
is the context bucket's, so a 300-token request in the 4096 bucket copies 4096 entries per layer.
Here each program follows the page table itself, reads a request's entries once and stops at the
request's own length. It reads only device tensors and its launch grid depends only on shapes, so
the static decode step (`decode_graphs.py`) captures it in its CUDA graph.

Split-K over the entries (flash-decoding): grid (B, Hk, S). Program (b, h, s) takes the s-th chunk
of request b's entries for KV head h and all g query heads of that GQA group at once (each K/V
entry is read once per group, and the group's queries form the rows of one `tl.dot`), keeps an
online softmax in fp32, and writes its chunk's normalised output and log-sum-exp; a second kernel
merges the S chunks (with S == 1 the first kernel writes the output itself). S is chosen from the
shapes only (batch rows, KV heads, padded width), so one graph per bucket stays valid; it is a
launch dimension, not a compile-time constant, so the graph buckets share a few compiled kernels.
fp32 inputs take IEEE dots (no TF32), so the fp32 output equals the gather path's to rounding; with
fp16 / bf16 inputs Q K^T runs in their dtype on the tensor cores and P @ V in TF32 (fp32 probabilities, 10-bit
mantissa, not rounded to bf16 as FlashAttention does: bf16 errors stay at the output's rounding).

The gather path is the fallback (no Triton, CPU tensors, the attention mass H2O needs) and the
test oracle: tests/test_rollout_triton_decode.py runs this kernel under Triton's interpreter
(`TRITON_INTERPRET=1`, CPU, numpy) and on the GPU against it (docs/rollout.md, "Triton paged
decode attention").

Shape legend: B requests, Hq query heads, Hk KV heads, g = Hq / Hk, d head dim, P pages per row.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs and CI: the engine keeps the gather path
    triton = None

# Entries per inner step of a program, and warps per program by dtype: compiled for sm_90 (ptxas -v,
# group 7, d 64) bf16 uses 158 registers at 4 warps, fp32 (IEEE dots, no tensor cores) 98 at 8
# warps, neither spills (at 64 entries and 4 warps fp32 spilled 484 bytes, bf16 took 242 registers).
BLOCK_N = 32
# Programs a launch aims at (B * Hk * S): a few waves of the GPU's SMs; fewer rows, more splits.
PROGRAMS_PER_SM = 4
_CPU_SMS = 16  # the interpreter's stand-in SM count (it only shapes S)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Triton's interpreter is on (`TRITON_INTERPRET=1`): kernels run on CPU tensors with numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def importable() -> bool:
    """The real Triton wheel imports (not absent, not SGLang's CPU stand-in, which has no file)."""
    return triton is not None and getattr(triton, "__file__", None) is not None


def usable(t: torch.Tensor) -> bool:
    """Whether `paged_decode` can run on tensors like `t`: Triton imports, and `t` is a CUDA tensor
    (or a CPU one under the interpreter), in one of DTYPES."""
    return importable() and t.dtype in DTYPES and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


def why_unusable(device: torch.device) -> str | None:
    """None when the kernel can run on `device`, else one line saying why not."""
    if not importable():
        return "triton is not importable here (pip install triton; GPU images ship it with torch)"
    if device.type != "cuda" and not interpreting():
        return f"device {device} is not CUDA (TRITON_INTERPRET=1 runs the kernel on CPU, slowly, for tests)"
    return None


def num_splits(rows: int, kv_heads: int, entries: int, device: torch.device) -> int:
    """Chunks per (request, KV head): enough programs to fill the GPU, at least BLOCK_N entries each.
    A function of shapes only, never of the lengths, so a captured graph holds for every step."""
    blocks = max(1, -(-entries // BLOCK_N))
    wanted = -(-PROGRAMS_PER_SM * _sm_count(device) // (rows * kv_heads))
    return max(1, min(blocks, wanted))


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    page_size: int,
    splits: int | None = None,
) -> torch.Tensor:
    """One query per request over its own pages: out [B, Hq, d] in q's dtype.

    q [B, Hq, d]; k_rows / v_rows [pages, page_size * Hk * d] (one layer of the pool, a row per page,
    each row [page_size, Hk, d] contiguous); pages int64 [B * P] (each request's table padded to P
    with any valid page); lengths int64 [B], 1 <= lengths[b] <= P * page_size (entries past a
    request's length are never read). splits: chunks per (request, KV head); default `num_splits`.
    """
    B, Hq, d = q.shape
    kv_heads = k_rows.shape[1] // (page_size * d)
    if k_rows.dtype != q.dtype or v_rows.dtype != q.dtype or q.dtype not in DTYPES:
        raise ValueError(f"q {q.dtype}, k {k_rows.dtype}, v {v_rows.dtype}: one dtype of {DTYPES} wanted")
    if kv_heads < 1 or Hq % kv_heads or k_rows.shape[1] != page_size * kv_heads * d:
        raise ValueError(
            f"q {tuple(q.shape)}, K rows {tuple(k_rows.shape)}: do not fit page_size={page_size}"
        )
    if k_rows.stride(1) != 1 or v_rows.stride(1) != 1 or v_rows.stride(0) != k_rows.stride(0):
        raise ValueError("K and V rows must be one contiguous row per page, with the same page stride")
    group, per_row = Hq // kv_heads, pages.numel() // B
    entries = per_row * page_size
    s = splits if splits is not None else num_splits(B, kv_heads, entries, q.device)
    chunk = -(-entries // (s * BLOCK_N)) * BLOCK_N  # entries per split, in whole blocks
    s = max(1, -(-entries // chunk))
    if q.stride(2) != 1:
        q = q.contiguous()
    # Triton's interpreter (3.9.0) mishandles bf16 twice: tl.dot multiplies the operands' raw uint16
    # bits, and fp32 -> bf16 truncates (the GPU rounds to nearest even). Under it, Q K^T gets fp32
    # operands holding the same bf16 values (exact products, fp32 sums: the GPU's arithmetic) and
    # the output is written in fp32, then rounded by torch.
    interp_bf16 = interpreting() and q.dtype == torch.bfloat16
    out = torch.empty(B, Hq, d, dtype=torch.float32 if interp_bf16 else q.dtype, device=q.device)
    if s == 1:
        part, lse = out, out  # the chunk kernel writes the output; no log-sum-exp is stored
    else:
        part = torch.empty(B, Hq, s, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, s, dtype=torch.float32, device=q.device)
    meta = chunk_meta(q.dtype, group=group, head_dim=d, page_size=page_size, kv_heads=kv_heads, splits=s)
    _chunk_kernel[(B, kv_heads, s)](
        q, k_rows, v_rows, pages, lengths, part, lse,
        math.log2(math.e) / math.sqrt(d), k_rows.stride(0), per_row, chunk, q.stride(0), q.stride(1),
        **meta, UPCAST=interp_bf16,
    )  # fmt: skip
    if s > 1:
        _merge_kernel[(B, Hq)](part, lse, out, s, **merge_meta(head_dim=d, splits=s))
    return out.to(q.dtype)


def chunk_meta(
    dtype: torch.dtype, *, group: int, head_dim: int, page_size: int, kv_heads: int, splits: int
) -> dict:
    """The chunk kernel's compile-time parameters and warps (also what tests compile for sm_90).
    The split count itself is not one (the grid's third dimension): every bucket of the decode
    graphs would compile its own kernel."""
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        KV_HEADS=kv_heads,
        DIRECT=splits == 1,  # one split: the chunk kernel writes the output itself
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # padded to the tensor cores' minimum tile
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=8 if dtype == torch.float32 else 4,
    )


def merge_meta(*, head_dim: int, splits: int) -> dict:
    """The merge kernel's compile-time parameters (the split count only through its power of 2)."""
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pages_ptr,
        lengths_ptr,
        part_ptr,
        lse_ptr,
        scale_log2,
        page_stride,
        pages_per_row,
        chunk,
        q_stride_b,
        q_stride_h,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        KV_HEADS: tl.constexpr,
        DIRECT: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Program (b, h, s): entries [s * chunk, min((s + 1) * chunk, length)) of request b, KV
        head h, the GROUP query heads h * GROUP ... at once (rows of the dots)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(lengths_ptr + b).to(tl.int32)
        start = s * chunk
        end = tl.minimum(start + chunk, length)
        g = tl.arange(0, BLOCK_G)
        dim = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = dim < HEAD_DIM
        heads = h * GROUP + g
        q_at = q_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h + dim[None, :]
        q = tl.load(q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
        total = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - top)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table = pages_ptr + b.to(tl.int64) * pages_per_row
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            ok = n < end
            page = tl.load(table + n // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            at = page * page_stride + (n % PAGE_SIZE) * (KV_HEADS * HEAD_DIM) + h * HEAD_DIM  # [BLOCK_N]
            kt = tl.load(k_ptr + at[None, :] + dim[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            scores = tl.dot(q, kt, input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))  # finite: every block holds entry `first`
            rescale = tl.exp2(top - new_top)
            p = tl.exp2(scores - new_top[:, None])
            total = total * rescale + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + dim[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            top = new_top
        # an empty chunk (past the length) has total 0: weight 0 in the merge, never 0 / 0
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        row = b.to(tl.int64) * (KV_HEADS * GROUP) + heads  # [BLOCK_G] flat (b, query head)
        keep = g_ok[:, None] & d_ok[None, :]
        if DIRECT:
            at_out = row[:, None] * HEAD_DIM + dim[None, :]
            tl.store(part_ptr + at_out, out.to(part_ptr.dtype.element_ty), mask=keep)
        else:
            splits = tl.num_programs(2)
            at_part = (row[:, None] * splits + s) * HEAD_DIM + dim[None, :]
            tl.store(part_ptr + at_part, out, mask=keep)
            lse = tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
            tl.store(lse_ptr + row * splits + s, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (b, query head): the `splits` chunk outputs weighted by their softmax mass."""
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        dim = tl.arange(0, BLOCK_D)
        s_ok = s < splits
        lse = tl.load(lse_ptr + row * splits + s, mask=s_ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # chunk 0 always holds entries: the max is finite
        at = (row * splits + s[:, None]) * HEAD_DIM + dim[None, :]
        part = tl.load(part_ptr + at, mask=s_ok[:, None] & (dim[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(out_ptr + row * HEAD_DIM + dim, out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_DIM)
