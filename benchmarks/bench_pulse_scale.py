"""PULSELoCo's payload at the scale its claim is about: the Qwen2.5-0.5B shape at RL learning rates.

    python -m benchmarks.bench_pulse_scale --full [--lrs 1e-6 3e-6] [--hs 4 8 16] [--json OUT]
    python -m benchmarks.bench_pulse_scale            # the quick shape (`make bench`), ~a minute

Bytes only: quality stays measured on the small tasks (bench_diloco). The 0.14M-parameter demo
model crosses a BF16 cell with 53-83 % of its elements per round at the learning rates where it
learns; the paper's 17x / 100x is about large models at RL learning rates, measured here.

Each of `--islands` islands starts from one anchor, random weights of realistic scale (a
transformers Qwen2 model) with the FP32 master inside each BF16 rounding interval (a master
mid-training, `sparserl sync bench --mid-training`), and takes max(--hs) Adam steps (megatron-style
mixed precision: FP32 master, BF16 weights) on the next-token loss of its own random token sequences
(`sparserl sync bench`'s synthetic loss; islands differ in data). After H inner steps, for each H in
--hs, the first outer step is measured exactly as the islands' outer step codes it: the PULSE gate
(`diloco.gate.pulse_gate`, error feedback empty in a first round) on anchor - master, and the
payload (`diloco.payload.encode`, positions coded against the anchor's BF16 bits).
Per (lr, H), islands summed:
  gate density       sent entries / N (N = the model's elements, a tied embedding once)
  PULSELoCo bytes    the payloads
  DiLoCo bytes       4 B x N x islands (dense FP32 pseudo-gradients, one outer step)
  DDP bytes          4 B x N x islands x H (an FP32 gradient all-reduce per inner step;
                     bench_diloco's accounting)
  bytes per entry    payload bytes / sent entries (the authors send 12 B)
Limit: the first outer round only (no residual carried yet): later rounds add what earlier ones held
back, which the small-task runs measure (bench_diloco, docs/benchmarks.md "DiLoCo islands").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparserl_mcore.diloco import payload
from sparserl_mcore.diloco.gate import bf16_bits, pulse_gate
from sparserl_mcore.sync.bench import QUICK, QWEN25_05B, MixedPrecisionAdam


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.bench_pulse_scale", description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the Qwen2.5-0.5B shape (default: the quick shape)")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    p.add_argument("--hs", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--islands", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    if min(args.hs) < 1 or args.islands < 2 or min(args.lrs) <= 0 or args.batch < 1 or args.seq_len < 1:
        p.error("--hs >= 1, --islands >= 2, --lrs > 0, --batch and --seq-len >= 1")
    return args


def _model(full: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # every island and lr starts from the same weights
    return Qwen2ForCausalLM(Qwen2Config(**(QWEN25_05B if full else QUICK))).bfloat16().train()


def _island_gates(args: argparse.Namespace, lr: float, island: int) -> dict[int, dict[str, Any]]:
    """One island's run: {H: (sent entries, payload bytes)} of the first outer step after H steps."""
    model = _model(args.full)
    opt = MixedPrecisionAdam(model, lr, mid_training=True)  # the same masters on every island
    anchor = [m.detach().clone() for m in opt.master]
    base = np.concatenate([bf16_bits(a).flatten().numpy().view(np.uint16) for a in anchor])
    gen = torch.Generator().manual_seed(100 + island)
    vocab = model.config.vocab_size
    out = {}
    for step in range(1, max(args.hs) + 1):
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen)
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        if step in args.hs:
            out[step] = _first_outer_step(anchor, opt.master, base)
            density = out[step]["sent"] / base.size
            print(f"  lr {lr:.0e} island {island} H={step}: density {density:.4f}", flush=True)
    return out


@torch.no_grad()
def _first_outer_step(anchor: list[torch.Tensor], master: list[torch.Tensor], base: np.ndarray) -> dict:
    """The gate tensor by tensor (elementwise, so bounded temporaries), then ONE payload over the
    flat shard, as `OuterStep` sends it."""
    idx, values, offset = [], [], 0
    for a, m in zip(anchor, master, strict=True):
        a, delta = a.flatten(), (a - m.detach()).flatten()
        i, v = pulse_gate(a, delta, torch.zeros_like(a))
        idx.append(i.numpy() + offset)
        values.append(v.numpy())
        offset += a.numel()
    blob = payload.encode(np.concatenate(idx), np.concatenate(values), base)
    return {"sent": int(sum(i.size for i in idx)), "payload_bytes": len(blob)}


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for lr in args.lrs:
        runs = [_island_gates(args, lr, island) for island in range(args.islands)]
        n = sum(p.numel() for p in _model(args.full).parameters())
        for h in sorted(set(args.hs)):
            sent = sum(r[h]["sent"] for r in runs)
            pulse = sum(r[h]["payload_bytes"] for r in runs)
            diloco, ddp = 4 * n * args.islands, 4 * n * args.islands * h
            rows.append(
                {
                    "lr": lr,
                    "H": h,
                    "elements": n,
                    "density": sent / (n * args.islands),
                    "payload_bytes": pulse,
                    "diloco_bytes": diloco,
                    "ddp_bytes": ddp,
                    "vs_diloco": diloco / pulse,
                    "vs_ddp": ddp / pulse,
                    "bytes_per_entry": pulse / max(1, sent),
                }
            )
    return rows


def main(argv: list[str]) -> int:
    args = _args(argv)
    torch.set_grad_enabled(True)
    shape = "Qwen2.5-0.5B shape" if args.full else "quick shape"
    print(f"PULSELoCo first outer step, {shape}, {args.islands} islands, batch {args.batch} x {args.seq_len}")
    rows = _rows(args)
    head = f"{'lr':>7} {'H':>3} {'density':>8} {'payload MB':>10} {'vs DiLoCo':>9} {'vs DDP':>8}"
    print(f"{head} {'B/entry':>7}")
    for r in rows:
        print(
            f"{r['lr']:>7.0e} {r['H']:>3} {r['density']:>8.4f} {r['payload_bytes'] / 2**20:>10.2f} "
            f"{r['vs_diloco']:>8.1f}x {r['vs_ddp']:>7.1f}x {r['bytes_per_entry']:>7.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
