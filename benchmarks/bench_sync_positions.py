"""Cost of the `base` position model at Qwen2.5-0.5B tensor sizes, against plain positions and a dense save.

Why a separate bench: `sparserl sync bench --full` needs ~10-12 GB; this one builds the tensors the
position model's time depends on (the 151936 x 896 embedding and one decoder layer, ~150M elements,
~1 GB RAM in all) with bf16 N(0, 0.02) values and synthetic changes drawn as Adam does them at a
small lr (an element flips with probability ~ lr / ulp(w), one ulp up or down), at a few sparsities.
Rounds alternate base / plain / dense save so the shared machine's noise hits all alike; per-element
costs (ns per element of the touched tensors) are the base-minus-plain time of the fastest rounds.

`python -m benchmarks bench_sync_positions [--sparsities 99.5 99 98 92] [--rounds 3]`
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from sparserl_mcore.sync.codec import (
    CodecConfig,
    Patch,
    TensorChange,
    decode_patch,
    encode_patch,
    resolve_positions,
)

# one Qwen2.5-0.5B decoder layer plus the (tied) embedding
SHAPES = {
    "embed_tokens": (151936, 896),
    "q_proj": (896, 896),
    "k_proj": (128, 896),
    "v_proj": (128, 896),
    "o_proj": (896, 896),
    "gate_proj": (4864, 896),
    "up_proj": (4864, 896),
    "down_proj": (896, 4864),
}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=gen) * 0.02).bfloat16() for n, s in SHAPES.items()}


def _flip_scale(exponents: np.ndarray, changed_share: float) -> float:
    """a with sum(min(1, a * 2**-e)) / numel = changed_share (bisection on the exponent histogram)."""
    counts = np.bincount(exponents, minlength=256).astype(np.float64)
    log_inv_ulp = -np.arange(256, dtype=np.float64)
    lo, hi = -400.0, 400.0  # log2(a)
    for _ in range(60):
        mid = (lo + hi) / 2
        if (counts * np.minimum(1.0, 2.0 ** (mid + log_inv_ulp))).sum() < changed_share * exponents.size:
            lo = mid
        else:
            hi = mid
    return 2.0**hi


def _changes(weights: dict[str, torch.Tensor], sparsity: float, seed: int) -> list[TensorChange]:
    """Adam-like flips: probability ~ 1 / ulp(w) (by exponent), one ulp up or down."""
    rng = np.random.default_rng(seed)
    out = []
    for name, w in weights.items():
        bits = w.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        exponents = ((bits >> 7) & 0xFF).astype(np.int64)
        scale = _flip_scale(exponents, 1 - sparsity / 100)
        p = np.minimum(1.0, scale * 2.0 ** -exponents.astype(np.float64))
        idx = np.flatnonzero(rng.random(bits.size) < p)
        old = bits[idx]
        step = np.where((rng.random(idx.size) < 0.5) & ((old & 0x7FFF) > 0), -1, 1).astype(np.int32)
        new = (old.astype(np.int32) + step).astype(np.uint16)
        out.append(
            TensorChange(
                name=name,
                dtype="bfloat16",
                shape=tuple(w.shape),
                indices=idx,
                new_bits=new,
                old_bits=old,
                digest=bytes(16),
                base_bits=bits,
            )
        )
    return out


def _patch(changes: list[TensorChange], numel: int) -> Patch:
    return Patch(
        version=1,
        base_version=0,
        anchor_version=0,
        model_digest=bytes(16),
        model_tensors=len(changes),
        model_numel=numel,
        tensors=tuple(changes),
    )


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run(sparsities: list[float], rounds: int) -> None:
    weights = _weights(0)
    numel = sum(w.numel() for w in weights.values())
    base_of = {n: w.view(torch.int16).numpy().view(np.uint16).reshape(-1) for n, w in weights.items()}
    print(f"{numel / 1e6:.1f}M elements in {len(weights)} tensors; ns per element of the touched tensors")
    print(
        "| sparsity | B/chg base / plain | encode ms base / plain | resolve ms base / plain "
        "| dense save ms | extra ns/elem encode / resolve |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "dense.safetensors"
        for sparsity in sparsities:
            patch = _patch(_changes(weights, sparsity, seed=1), numel)
            nnz = sum(c.nnz for c in patch.tensors)
            best: dict[str, float] = {}
            size = {}
            for _ in range(rounds):
                for model in ("base", "plain"):
                    config = CodecConfig(encoding="sub", position_model=model)
                    data, t_enc = _timed(lambda config=config, patch=patch: encode_patch(patch, config))
                    decoded = decode_patch(data)
                    _, t_res = _timed(lambda decoded=decoded: resolve_positions(decoded, base_of.__getitem__))
                    size[model] = len(data)
                    best[f"enc {model}"] = min(best.get(f"enc {model}", np.inf), t_enc)
                    best[f"res {model}"] = min(best.get(f"res {model}", np.inf), t_res)
                _, t_save = _timed(lambda: save_file(weights, str(target)))
                best["save"] = min(best.get("save", np.inf), t_save)
            extra_enc = (best["enc base"] - best["enc plain"]) / numel * 1e9
            extra_res = (best["res base"] - best["res plain"]) / numel * 1e9
            print(
                f"| {sparsity} % | {size['base'] / nnz:.3f} / {size['plain'] / nnz:.3f} "
                f"| {best['enc base'] * 1e3:.0f} / {best['enc plain'] * 1e3:.0f} "
                f"| {best['res base'] * 1e3:.0f} / {best['res plain'] * 1e3:.0f} | {best['save'] * 1e3:.0f} "
                f"| {extra_enc:.2f} / {extra_res:.2f} |",
                flush=True,
            )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_sync_positions", description=__doc__.splitlines()[0])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[99.5, 99.0, 98.0, 92.0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the fastest counts")
    args = parser.parse_args(argv)
    run(args.sparsities, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
