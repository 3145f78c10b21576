"""LM head + per-token log-prob + entropy, forward and backward, one learner micro-batch on the GPU:
today's path vs the fused head (loss/fused_logprob.py, Triton on CUDA) vs Liger's fused linear
cross-entropy when `liger_kernel` is importable (a reference to beat, not a dependency).

    python -m benchmarks.gpu.logprob [--out gpu-results] [--tokens 8192] [--hidden 896]
                                     [--vocab 151936] [--repeats 5] [--smoke]

bf16 hidden states [s, b, H] and head [V, H] with an fp32 `main_grad` (megatron's DDP buffer),
temperature 0.8, both gradients (log-prob and entropy) flowing back, every token scored.
- today: megatron's output layer (logits [s, b, V]), GPTModel's `transpose(0, 1).contiguous()`,
  `vocab_parallel_logprobs` on `logits[:, :-1]`; dW returned in bf16 and added to main_grad as
  DDP's hook does;
- fused: `linear_logprobs` with gradient accumulation fusion (dW straight into main_grad);
- liger: `LigerFusedLinearCrossEntropyFunction` with reduction "none" (log-prob only, no entropy,
  no padded-vocabulary exclusion).
Time: median wall clock of fwd+bwd between device synchronisations. Extra GiB: peak allocated
during one fwd+bwd minus what was allocated before (inputs, weights, main_grad). Goal (issue 34):
fused <= 18 ms and <= 3 GiB extra at 8,192 tokens, H=896, V=151,936 on an H100.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.gpu import common

SMOKE_SHAPE = {"tokens": 64, "hidden": 32, "vocab": 500}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.logprob", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (b = 4 sequences)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device (no figures)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE_SHAPE, repeats=1)
    return args


def _today(hidden, weight, tokens, grads):
    from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs

    logits = torch.matmul(hidden, weight.t()).transpose(0, 1).contiguous()  # [b, s, V]
    logp, ent = vocab_parallel_logprobs(
        logits[:, :-1], tokens[:, 1:], group=None, vocab_start=0, temperature=0.8
    )
    ((logp * grads[0]).sum() + (ent * grads[1]).sum()).backward()
    weight.main_grad.add_(weight.grad)
    weight.grad = None


def _fused(hidden, weight, tokens, grads):
    from sparserl_mcore.loss.fused_logprob import linear_logprobs

    h = hidden[:-1].reshape(-1, hidden.shape[-1])
    target = tokens[:, 1:].t().reshape(-1)
    logp, ent = linear_logprobs(
        h, weight, target, group=None, vocab_start=0, temperature=0.8, gradient_accumulation_fusion=True
    )
    g_lp, g_h = (g.t().reshape(-1) for g in grads)
    ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
    weight.grad = None  # the dummy megatron's protocol returns


def _liger(hidden, weight, tokens, grads):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    h = hidden[:-1].reshape(-1, hidden.shape[-1]) / 0.8  # the temperature folded into the input
    target = tokens[:, 1:].t().reshape(-1)
    loss = LigerFusedLinearCrossEntropyFunction.apply(h, weight, target, None, None, -100, 0.0, 0.0, "none")
    loss = loss[0] if isinstance(loss, tuple) else loss
    (-loss * grads[0].t().reshape(-1)).sum().backward()
    weight.main_grad.add_(weight.grad)
    weight.grad = None


def _measure(name, fn, args, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    b = 4 if args.tokens % 4 == 0 else 1
    s = args.tokens // b
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(s, b, args.hidden, device=device, generator=gen).to(dtype).requires_grad_(True)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=device, generator=gen)).to(dtype)
    weight.requires_grad_(True)
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    weight.grad_added_to_main_grad = False
    tokens = torch.randint(0, args.vocab, (b, s), device=device, generator=gen)
    grads = (
        torch.randn(b, s - 1, device=device, generator=gen),
        torch.randn(b, s - 1, device=device, generator=gen),
    )

    def step() -> None:
        hidden.grad = None
        fn(hidden, weight, tokens, grads)

    times = common.wall_times(step, device, warmup=1, repeats=args.repeats)
    extra = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        extra = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    flops = 6.0 * b * (s - 1) * args.hidden * args.vocab  # the head's three GEMMs
    ms = common.median(times) * 1e3
    return {"path": name, "ms": ms, "head_tflops": flops / (ms / 1e3) / 1e12, "extra_gib": extra}


def main(argv: list[str]) -> int:
    args = _args(argv)
    device = common.device_for(args.smoke)
    env = common.environment(device)
    notes = [
        f"{args.tokens} tokens, H={args.hidden}, V={args.vocab}, T=0.8, fwd+bwd, median of {args.repeats}"
    ]
    paths = {"today": _today, "fused": _fused}
    try:
        import liger_kernel  # noqa: F401

        paths["liger"] = _liger
    except ImportError:
        notes.append("liger: liger_kernel is not importable")
    if device.type == "cuda":
        from sparserl_mcore.loss import fused_logprob_triton

        notes.append(f"fused: {'Triton kernels' if fused_logprob_triton.available() else 'torch path'}")
    rows = []
    for name, fn in paths.items():
        try:
            rows.append(_measure(name, fn, args, device))
        except Exception as exc:  # one path failing (e.g. liger's API moved) must not hide the others
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.smoke:
        notes.append("SMOKE run: tiny shape, figures mean nothing")
    columns = [("path", "path"), ("ms", "ms"), ("head_tflops", "head TFLOP/s"), ("extra_gib", "extra GiB")]
    common.print_table(f"LM head + log-prob fwd+bwd, {env['device']}", rows, columns)
    print(common.write_record(args.out, "logprob", env, rows, notes))
    return 0 if {r["path"] for r in rows} >= {"today", "fused"} else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
