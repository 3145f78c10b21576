"""C kernels compiled at first use with the system C compiler and called through ctypes.

Why: on CPU at rollout batch sizes, decode attention through torch copies every request's pages
(`index_select`) before SDPA reads them again; `csrc/paged_decode.c` reads each K/V entry in
place, once (docs/rollout.md, "Step cost"). Optional by design: no compiler, a failed build, a
non-CPU tensor or `SPARSERL_NATIVE=0` leaves the caller on its torch path.

The shared library is cached per user (`$XDG_CACHE_HOME/sparserl_mcore`, else
`~/.cache/sparserl_mcore`) under a name keyed by the source, the flags, the compiler's version
and the CPU (`-march=native` code can be illegal on another CPU sharing a home directory), and
written atomically (temp file + rename), so concurrent first uses cannot load a
half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "SPARSERL_NATIVE"
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math lets gcc vectorise the score reductions and call the vector expf (libmvec)
FLAGS = ("-O3", "-ffast-math", "-march=native", "-std=c99", "-shared", "-fPIC")


class PagedDecode:
    """`paged_decode_f32` from csrc/paged_decode.c: fp32 decode attention over page tables."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.paged_decode_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float]

    def __call__(
        self,
        q: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        pages: torch.Tensor,
        lengths: torch.Tensor,
        *,
        kv_heads: int,
        page_size: int,
        want_mass: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, Hq, d] fp32; k_rows / v_rows [pages, page_size * Hk * d] fp32 contiguous (one
        pool layer); pages int64 [B * P] (each request's table padded to P); lengths int64 [B],
        each in 1..P * page_size. Returns out [B, Hq, d] and, with `want_mass`, the attention each
        entry got, max over a KV head's query heads: [B, Hk, P * page_size], 0 past each length."""
        B, Hq, d = q.shape
        # and-chains, not a generator over the tensors: this runs per layer per decode step
        if not (q.is_cpu and k_rows.is_cpu and v_rows.is_cpu and pages.is_cpu and lengths.is_cpu) or not (
            q.is_contiguous()
            and k_rows.is_contiguous()
            and v_rows.is_contiguous()
            and pages.is_contiguous()
            and lengths.is_contiguous()
        ):
            raise ValueError("paged_decode: every tensor must be a contiguous CPU tensor")
        if not (q.dtype == k_rows.dtype == v_rows.dtype == torch.float32) or not (
            pages.dtype == lengths.dtype == torch.int64
        ):
            raise ValueError("paged_decode: q / k_rows / v_rows must be float32, pages / lengths int64")
        if Hq % kv_heads or k_rows.shape[1] != page_size * kv_heads * d or pages.numel() % B:
            raise ValueError(
                f"paged_decode: shapes do not agree: q {tuple(q.shape)}, k_rows {tuple(k_rows.shape)}, "
                f"kv_heads={kv_heads}, page_size={page_size}, {pages.numel()} page ids for {B} requests"
            )
        out = torch.empty_like(q)
        mass = torch.zeros(B, kv_heads, pages.numel() // B * page_size) if want_mass else None
        rc = self._fn(
            q.data_ptr(),
            k_rows.data_ptr(),
            v_rows.data_ptr(),
            pages.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            None if mass is None else mass.data_ptr(),
            B,
            Hq,
            kv_heads,
            d,
            page_size,
            pages.numel() // B,
            1 / math.sqrt(d),
        )
        if rc != 0:
            reason = "a length is < 1 or beyond its page table" if rc == -1 else "out of memory"
            raise ValueError(f"paged_decode: {reason} (lengths {lengths.tolist()})")
        return out, mass


@functools.cache
def paged_decode() -> PagedDecode | None:
    """The kernel, built and loaded once per process; None (logged once) when disabled or unbuildable."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    try:
        return PagedDecode(ctypes.CDLL(str(_build(SOURCE))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native paged decode unavailable, using the torch path: %s", e)
        return None


def _build(source: Path) -> Path:
    """Compile `source` into the cache (or reuse a build of the same source, flags, compiler and CPU)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (cc / gcc, or set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    parts = [source.read_text(), *FLAGS, cc, version, _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparserl_mcore"
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_id() -> str:
    """The CPU's model and feature flags (Linux), else the architecture: part of the cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
