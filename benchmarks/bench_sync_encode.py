"""Sparse encode speed without training: `make_patch` + `encode_patch` vs a dense safetensors save.

The Qwen2.5-0.5B HF tensor shapes (`--scale` shrinks the embedding and MLP rows; 1.0 = 494M
parameters) filled with N(0, 0.02) BF16 weights; each `--changed` fraction of elements moves in
its bit pattern: `--flips uniform` spreads the changes evenly, +-1..2 (the `base` position model
then finds no classes worth coding), `--flips adam` flips an element by one ulp with probability
~ 1 / ulp(w), as small Adam steps do (bench_sync_positions), so `base` codes classes as in
training. Rounds alternate encode and dense save so both see the same load on a shared machine;
per stage the fastest round (wall and process CPU seconds) and the median wall are printed. The
encoded bytes must be equal in every round.

`python -m benchmarks bench_sync_encode` (scale 1/8: 100M parameters, ~20 s, 1.2 GB peak);
`... --scale 1 --changed 0.1 0.02` is the 0.5B shape at 90 % / 98 % sparsity (~4 GB);
`... --scale 1 --changed 0.01 --flips adam` the realistic ~99 % case for the `base` model.
Results: docs/benchmarks.md, "Sparse sync".
The training-based `sparserl sync bench --full` remains the reference run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.bench_sync_positions import _flip_scale
from sparserl_mcore.sync.bench import QWEN25_05B
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.diff import make_patch
from sparserl_mcore.sync.hashing import state_dict_digests


def qwen_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of the Qwen2.5-0.5B config (tied embedding listed once)."""
    c = QWEN25_05B
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    kv_dim, mlp = hidden // heads * kv, max(1, round(c["intermediate_size"] * scale))
    shapes = {"model.embed_tokens.weight": (max(1, round(c["vocab_size"] * scale)), hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.k_proj.bias": (kv_dim,),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.bias": (kv_dim,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes | {"model.norm.weight": (hidden,)}


def _adam_flips(flat: np.ndarray, changed: float, rng: np.random.Generator) -> None:
    """Flip elements of `flat` (int16 bf16 patterns, in place) one ulp up or down with probability
    ~ 1 / ulp(w), scaled so that ~`changed` of them flip (zeros only move up)."""
    exponents = (flat.view(np.uint16) >> 7) & 0xFF
    scale = _flip_scale(exponents.astype(np.int64), changed)
    by_exponent = np.minimum(1.0, scale * 2.0 ** -np.arange(256, dtype=np.float64)).astype(np.float32)
    moved = np.flatnonzero(rng.random(flat.size, dtype=np.float32) < by_exponent[exponents])
    down = (rng.random(moved.size) < 0.5) & ((flat[moved] & 0x7FFF) > 0)
    flat[moved] += np.where(down, -1, 1).astype(np.int16)


def states(scale: float, changed: float, flips: str = "uniform", seed: int = 0) -> tuple[dict, dict]:
    """(old, new) BF16 state dicts; ~`changed` of the elements differ (`flips`: see the module doc)."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in qwen_shapes(scale).items():
        weights = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * 0.02).bfloat16()
        bits = weights.view(torch.int16).numpy().copy()
        flat = bits.reshape(-1)
        if flips == "adam":
            _adam_flips(flat, changed, rng)
        else:
            moved = np.flatnonzero(rng.random(flat.size, dtype=np.float32) < changed)
            steps = rng.integers(1, 3, moved.size, dtype=np.int16) * rng.choice(
                np.array([-1, 1], np.int16), moved.size
            )
            flat[moved] += steps
        old[name], new[name] = weights, torch.from_numpy(bits).view(torch.bfloat16)
    return old, new


def _timed(fn) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure(scale: float, changed: float, flips: str, rounds: int, tmp: Path) -> dict:
    old, new = states(scale, changed, flips)
    digests = state_dict_digests(old)
    times: dict[str, list[tuple[float, float]]] = {
        "make_patch": [],
        "encode_patch": [],
        "encode": [],
        "save": [],
    }
    first = None
    for _ in range(rounds):
        patch, *diff_t = _timed(
            lambda: make_patch(old, new, version=1, base_version=0, anchor_version=0, old_digests=digests)
        )
        data, *enc_t = _timed(lambda p=patch: encode_patch(p))
        first = first if first is not None else data
        if data != first:
            raise RuntimeError("encode_patch gave different bytes for the same input")
        _, *save_t = _timed(lambda: save_file(new, tmp / "dense.safetensors"))
        times["make_patch"].append(tuple(diff_t))
        times["encode_patch"].append(tuple(enc_t))
        times["encode"].append((diff_t[0] + enc_t[0], diff_t[1] + enc_t[1]))
        times["save"].append(tuple(save_t))
        del patch
    numel = sum(t.numel() for t in new.values())
    return {"numel": numel, "changed": changed, "patch_bytes": len(first), "times": times}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_sync_encode", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.125, help="embedding/MLP rows vs Qwen2.5-0.5B")
    parser.add_argument("--changed", type=float, nargs="+", default=[0.1, 0.02], help="changed fractions")
    parser.add_argument("--flips", choices=("uniform", "adam"), default="uniform", help="how changes spread")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1 or args.rounds < 1 or not all(0 < c < 1 for c in args.changed):
        raise ValueError("--scale must be in (0, 1], --rounds >= 1, --changed fractions in (0, 1)")
    print(f"sparse encode vs dense save, threads {torch.get_num_threads()}, {args.rounds} alternating rounds")
    columns = {"params": 8, "sparsity": 9, "patch MB": 9, "stage": 13, "min wall s": 10, "med wall s": 10}
    print(" ".join(f"{name:>{width}}" for name, width in (columns | {"min cpu s": 9}).items()))
    with tempfile.TemporaryDirectory() as tmp:
        for changed in args.changed:
            r = measure(args.scale, changed, args.flips, args.rounds, Path(tmp))
            for stage, runs in r["times"].items():
                walls = [w for w, _ in runs]
                print(
                    f"{r['numel'] / 1e6:>7.1f}M {100 * (1 - changed):>8.1f}% "
                    f"{r['patch_bytes'] / 2**20:>9.2f} {stage:>13} {min(walls):>10.3f} "
                    f"{statistics.median(walls):>10.3f} "
                    f"{min(c for _, c in runs):>9.3f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
