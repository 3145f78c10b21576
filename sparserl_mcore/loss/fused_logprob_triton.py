"""Triton kernels of the fused log-prob (loss/fused_logprob.py) for CUDA: the softmax algebra of one
chunk read straight from the head GEMM's output in its own dtype (bf16), no fp32 [chunk, V] copy.

- `chunk_stats`: one program per row streams z = logits / T once with an online max, giving the
  local (max, sum exp, sum exp * (z - max)); the rows are rescaled to the TP-global max after the
  MAX all-reduce, so the SUM all-reduce carries the same three numbers as the torch path.
- `chunk_dz`: overwrites the GEMM output with dlogits = (onehot*g_lp - p*(g_lp + g_h*(z - E[z])))/T
  in place, padding columns 0.

Imported only when a CUDA tensor reaches `linear_logprobs`; the torch path there is the reference
(tests/test_loss_fused_logprob.py::test_triton_matches_torch_path, marked gpu).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from sparserl_mcore.loss.vocab_parallel import _group_size

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: linear_logprobs then runs the torch path
    triton = None

_BLOCK = 2048


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _stats_kernel(z_ptr, stride, n_valid, temperature, m_ptr, s_ptr, a_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        m = tl.full([], -1e30, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        a = tl.full([], 0.0, tl.float32)
        for start in range(0, n_valid, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_valid
            z = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32) / temperature
            new_m = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - new_m)
            zs = tl.where(ok, z - new_m, 0.0)
            e = tl.where(ok, tl.exp(zs), 0.0)
            a = scale * (a + (m - new_m) * s) + tl.sum(e * zs, 0)
            s = scale * s + tl.sum(e, 0)
            m = new_m
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(a_ptr + row, a)

    @triton.jit
    def _dz_kernel(
        z_ptr,
        stride,
        n_cols,
        n_valid,
        temperature,
        stats_ptr,
        n_rows,
        glp_ptr,
        gh_ptr,
        tgt_ptr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        ptr = z_ptr + row.to(tl.int64) * stride + cols
        z = tl.load(ptr, mask=inside, other=0.0).to(tl.float32) / temperature
        m = tl.load(stats_ptr + row)
        log_s = tl.load(stats_ptr + n_rows + row)
        mean = tl.load(stats_ptr + 2 * n_rows + row)  # E_p[z] - m
        g_lp = tl.load(glp_ptr + row)
        g_h = tl.load(gh_ptr + row)
        tgt = tl.load(tgt_ptr + row)  # local column of the target, -1 when another rank owns it
        zs = z - m
        p = tl.exp(zs - log_s)
        g = -p * (g_lp + g_h * (zs - mean)) + tl.where(cols == tgt, g_lp, 0.0)
        g = tl.where(cols < n_valid, g, 0.0) / temperature
        tl.store(ptr, g.to(z_ptr.dtype.element_ty), mask=inside)


def chunk_stats(
    hidden_c: Tensor, weight: Tensor, group, local_t: Tensor, owned: Tensor, temperature: float, n_valid: int
) -> tuple[Tensor, Tensor]:
    """(m, [sum exp(z - m), sum exp(z - m)(z - m), z_target]) of one chunk over the whole vocabulary."""
    z = torch.mm(hidden_c, weight.t())
    rows = z.shape[0]
    m_l, s_l, a_l = (torch.empty(rows, dtype=torch.float32, device=z.device) for _ in range(3))
    _stats_kernel[(rows,)](z, z.stride(0), n_valid, temperature, m_l, s_l, a_l, BLOCK=_BLOCK)
    z_t = z.gather(1, local_t[:, None]).squeeze(1).float() / temperature
    del z
    m = m_l.clone()
    if _group_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m_l - m)
    sums = torch.stack([s_l * scale, scale * (a_l + (m_l - m) * s_l), torch.where(owned, z_t, 0.0)])
    if _group_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return m, sums


def chunk_dz(
    hidden_c: Tensor,
    weight: Tensor,
    stats_c: Tensor,
    g_lp: Tensor | None,
    g_h: Tensor | None,
    local_t: Tensor,
    owned: Tensor,
    temperature: float,
    n_valid: int,
) -> Tensor:
    """d loss / d logits of one chunk, in the weight's dtype, written over the recomputed logits."""
    z = torch.mm(hidden_c, weight.t())
    rows, cols = z.shape
    zeros = torch.zeros(rows, dtype=torch.float32, device=z.device)
    tgt = torch.where(owned, local_t, -1)
    grid = (rows, triton.cdiv(cols, _BLOCK))
    _dz_kernel[grid](
        z, z.stride(0), cols, n_valid, temperature, stats_c.contiguous(), rows,
        zeros if g_lp is None else g_lp.contiguous(), zeros if g_h is None else g_h.contiguous(), tgt,
        BLOCK=_BLOCK,
    )  # fmt: skip
    return z
