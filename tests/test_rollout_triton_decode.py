"""The Triton paged decode-attention kernel (rollout/engine/triton_decode.py) against the gather path.

Runs where the kernel can: under Triton's interpreter on CPU (`TRITON_INTERPRET=1`, triton on the
path; CI has no triton, so there these tests skip with the reason) and on a GPU (marker gpu).

    pip install --target /tmp/triton-site triton
    PYTHONPATH=/tmp/triton-site:$PWD TRITON_INTERPRET=1 \
        python -m pytest -q tests/test_rollout_triton_decode.py

- random page tables (shuffled pages, pages shared between requests as the radix cache shares
  prompt pages, tables padded past what a request uses), ragged lengths with partial last pages,
  GQA groups of 1 to 8 (and 7, Qwen2.5-0.5B's), page sizes that do and do not divide the kernel's
  block, a head dim that is not a power of two, one split or several: fp32 equal to the gather
  path to 1e-5, fp16 / bf16 no further from the exact (fp64) result than the gather path's own
  output plus one rounding step of the dtype;
- an engine with the kernel (static step and eager step, SnapKV's compacted pages) generates the
  gather engine's tokens;
- both kernels compile for sm_90 (H100 / H200) on a CPU box (triton ships ptxas), half types on
  the tensor cores;
- GPU: a CUDA graph captured once replays correctly for new lengths and page tables (no host sync,
  nothing baked in). The engine with graphs and the kernel against HF greedy in fp32 is
  tests/test_gpu.py's engine test (the kernel is the default there).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hf_reference import tiny_qwen2

from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig, triton_decode
from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

NO_TRITON = "triton is not importable (CI has none; see this file's docstring for the command)"
NO_INTERPRETER = "CPU run needs Triton's interpreter: TRITON_INTERPRET=1 (this file's docstring)"


def _skip_unless_runnable(device: str) -> None:
    if not triton_decode.importable():
        pytest.skip(NO_TRITON)
    if device == "cpu" and not triton_decode.interpreting():
        pytest.skip(NO_INTERPRETER)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (device, splits): on the GPU each combination compiles, so there only the default split count
# (several splits at these sizes: the merge) and one split (the direct write)
PLACES = [("cpu", None), ("cpu", 1), ("cpu", 3)] + [
    pytest.param("cuda", s, marks=pytest.mark.gpu, id=f"cuda-{s}") for s in (None, 1)
]
VOCAB = 96


def _case(lengths, *, page_size, kv_heads, group, d, dtype, device, width=None, n_pages=None, seed=0):
    """A pool layer, q, and a layout: tables of shuffled pages, request 1 sharing request 0's first
    page (when it needs two), every table padded to `width` pages (a bucket's; default 2 spare)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    n_pages = n_pages or sum(need) + 3
    k_rows, v_rows = (
        torch.randn(n_pages, page_size * kv_heads * d, generator=g).to(dtype).to(device) for _ in range(2)
    )
    perm = torch.randperm(n_pages, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    if len(tables) > 1 and need[1] > 1:
        tables[1][0] = tables[0][0]  # a shared prompt page
    width = width or max(need) + 2
    padded = [t + [perm[-1]] * (width - len(t)) for t in tables]
    q = torch.randn(len(lengths), kv_heads * group, d, generator=g).to(dtype).to(device)
    layout = DecodeLayout.build(padded, list(lengths), page_size=page_size, dtype=dtype, device=device)
    return q, k_rows, v_rows, layout


def _exact(q, k_rows, v_rows, layout):
    """fp64 attention of each request over its own first `length` entries (the pool's own layout)."""
    B, Hq, d = q.shape
    P = layout.pages.numel() // B
    outs = []
    for b in range(B):
        n = int(layout.lengths[b])
        table = layout.pages[b * P : (b + 1) * P]
        k = k_rows[table].double().view(P * layout.page_size, -1, d)[:n]  # [n, Hk, d]
        v = v_rows[table].double().view(P * layout.page_size, -1, d)[:n]
        g = Hq // k.shape[1]
        kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, Hq, d]
        probs = torch.einsum("hd,nhd->hn", q[b].double(), kk).div(math.sqrt(d)).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", probs, vv))
    return torch.stack(outs)


SHAPES = [  # lengths, page_size, kv_heads, group, d
    ((5, 12, 1, 9, 33), 4, 2, 4, 16),
    ((70, 3, 129, 64), 16, 1, 8, 16),  # MHA-like group of 8, several blocks, exact-block length
    ((17, 40, 2), 5, 2, 7, 16),  # Qwen2.5-0.5B's group of 7; pages of 5 straddle the blocks
    ((100, 31), 128, 4, 1, 24),  # no GQA, one page longer than a block, head dim 24
]


@pytest.mark.parametrize(("device", "splits"), PLACES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{len(s[0])}-ps{s[1]}-hk{s[2]}-g{s[3]}-d{s[4]}")
def test_kernel_matches_the_gather_path(device, dtype, splits, shape):
    _skip_unless_runnable(device)
    lengths, page_size, kv_heads, group, d = shape
    q, k_rows, v_rows, layout = _case(
        lengths, page_size=page_size, kv_heads=kv_heads, group=group, d=d, dtype=dtype, device=device
    )
    gather, _ = decode_attention(q, k_rows, v_rows, layout, use_native=False)
    out = triton_decode.paged_decode(
        q, k_rows, v_rows, layout.pages, layout.lengths, page_size=page_size, splits=splits
    )
    assert out.dtype == dtype and out.shape == q.shape
    _assert_as_close_as_gather(out, gather, _exact(q, k_rows, v_rows, layout))


def _assert_as_close_as_gather(out, gather, exact):
    """fp32: within 1e-5 of the gather path; fp16 / bf16: no further from the exact result than the
    gather path's worst element plus one rounding step of the dtype at each value."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, gather, atol=1e-5, rtol=1e-5)
        return
    step = torch.finfo(out.dtype).eps * exact.abs().clamp(min=1e-3)
    kernel_err = (out.double() - exact).abs()
    gather_err = (gather.double() - exact).abs()
    assert (kernel_err <= gather_err.max() + step).all(), (kernel_err.max(), gather_err.max())


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_selects_the_kernel_only_when_asked_and_no_mass_is_wanted(device, monkeypatch):
    _skip_unless_runnable(device)
    shape = dict(page_size=4, kv_heads=2, group=2, d=16, dtype=torch.float32, device=device)
    q, k_rows, v_rows, layout = _case((9, 3), **shape)
    calls, real = [], triton_decode.paged_decode

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_decode, "paged_decode", counting)
    decode_attention(q, k_rows, v_rows, layout, use_native=False)
    assert calls == []
    decode_attention(q, k_rows, v_rows, layout, use_triton=True, want_mass=True)  # H2O: gather
    assert calls == []
    _, mass = decode_attention(q, k_rows, v_rows, layout, use_triton=True)
    assert calls == [1] and mass is None


def test_triton_decode_true_where_it_cannot_run_names_the_reason(tmp_path):
    if triton_decode.why_unusable(torch.device("cpu")) is None:
        pytest.skip("the kernel runs on this CPU (interpreter): nothing to refuse")
    tiny_qwen2(tmp_path / "m", VOCAB)
    with pytest.raises(ValueError, match="triton_decode=True: .*gather path"):
        EmbeddedEngine(tmp_path / "m", EngineConfig(device="cpu", triton_decode=True))
    engine = EmbeddedEngine(tmp_path / "m", EngineConfig(device="cpu"))
    assert engine.model_info()["decode_attention"] == "gather"


# Compiles both kernels for sm_90 (H100 / H200) the way `paged_decode` launches them, in a process
# without the interpreter: a CPU box has triton's ptxas, so a kernel that would not compile for the
# GPU fails here; fp16 / bf16 must reach the tensor cores (mma), fp32 must not (IEEE dots).
COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparserl_mcore.rollout.engine import triton_decode as td
hopper = GPUTarget("cuda", 90, 32)
names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
for dtype, name in names.items():
    for group, d, page, kv_heads, splits in ((7, 64, 16, 2, 1), (7, 64, 16, 2, 4), (1, 128, 5, 8, 3)):
        meta = td.chunk_meta(dtype, group=group, head_dim=d, page_size=page, kv_heads=kv_heads, splits=splits)
        options = {"num_warps": meta.pop("num_warps")}
        meta["UPCAST"] = False
        part = f"*{name}" if splits == 1 else "*fp32"
        sig = dict(q_ptr=f"*{name}", k_ptr=f"*{name}", v_ptr=f"*{name}", pages_ptr="*i64", lengths_ptr="*i64",
                   part_ptr=part, lse_ptr=part, scale_log2="fp32", page_stride="i32", pages_per_row="i32",
                   chunk="i32", q_stride_b="i32", q_stride_h="i32", **{k: "constexpr" for k in meta})
        kernel = triton.compile(ASTSource(td._chunk_kernel, sig, meta), target=hopper, options=options)
        assert ("mma." in kernel.asm["ptx"]) == (dtype != torch.float32), (name, group, d)
        if splits > 1:
            meta = td.merge_meta(head_dim=d, splits=splits)
            sig = dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{name}", splits="i32")
            sig |= dict.fromkeys(meta, "constexpr")
            triton.compile(ASTSource(td._merge_kernel, sig, meta), target=hopper)
print("compiled")
"""


def test_the_kernels_compile_for_hopper_without_a_gpu():
    if not triton_decode.importable():
        pytest.skip(NO_TRITON)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, env.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", COMPILE]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return tiny_qwen2(path, VOCAB), path


def _requests(n_new: int) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 11, 17, 3, 30)]
    params = SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
    return [GenerateRequest(input_ids=p, sampling=params) for p in prompts]


@pytest.mark.parametrize(
    "extra",
    [
        {"cuda_graph": True},  # the static step, padded rows on the scratch page
        {"cuda_graph": False},  # the eager step
        {"kv_compression": KVCompressionConfig(method="snapkv", budget=12, interval=4, window=4)},
    ],
    ids=["static", "eager", "snapkv"],
)
def test_an_engine_with_the_kernel_generates_what_the_gather_engine_does(model_dir, extra):
    _skip_unless_runnable("cpu")
    _, path = model_dir
    requests = _requests(10)
    tokens = {}
    for use in (True, False):
        cfg = EngineConfig(
            device="cpu",
            page_size=4,
            capacity_pages=128,
            cuda_graph_max_context=64,
            triton_decode=use,
            check_invariants=True,
            **extra,
        )
        engine = EmbeddedEngine(path, cfg)
        assert engine.model_info()["decode_attention"] == ("triton" if use else "gather")
        tokens[use] = [s.output_ids for s in engine.generate(requests)]
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
def test_a_captured_graph_replays_the_kernel_for_new_lengths_and_tables():
    _skip_unless_runnable("cuda")
    shape = dict(page_size=16, kv_heads=2, group=7, d=64, dtype=torch.bfloat16, device="cuda")
    shape |= dict(width=50, n_pages=80)  # one pool and table width for the capture and the replays
    q, k_rows, v_rows, layout = _case((300, 17, 1, 64), **shape)
    pages, lengths = layout.pages.clone(), layout.lengths.clone()
    out = triton_decode.paged_decode(q, k_rows, v_rows, pages, lengths, page_size=16)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.paged_decode(q, k_rows, v_rows, pages, lengths, page_size=16)
    for seed in (1, 2):
        new = _case((31, 700, 5, 2), **shape, seed=seed)[3]  # same pool, other tables and lengths
        pages.copy_(new.pages)
        lengths.copy_(new.lengths)
        q.normal_()
        graph.replay()
        want = triton_decode.paged_decode(q, k_rows, v_rows, pages, lengths, page_size=16)
        gather, _ = decode_attention(q, k_rows, v_rows, new, use_native=False)
        assert torch.equal(out, want)
        _assert_as_close_as_gather(out, gather, _exact(q, k_rows, v_rows, new))
