"""One learner log-prob micro-batch (LM head + log-prob + entropy, fwd + bwd): today vs the fused head.

- today: what the last stage runs now: megatron's output layer (logits [s, b, V] = hidden @ W^T),
  GPTModel's `transpose(0, 1).contiguous()`, `vocab_parallel_logprobs(logits[:, :-1], ...)`
  (default chunking), the output layer's dW / d_hidden GEMMs;
- fused (all rows): `linear_logprobs` (loss/fused_logprob.py, torch path) over every position;
- fused (response rows): the same over the response half only, as the trainer's loss runs it.
fp32 on CPU, TP = 1, temperature 0.8, both upstream gradients (log-prob and entropy). Each variant
runs in a fresh spawned process; peak memory is that process's peak RSS growth over what was
allocated before the step (hidden, W, targets); time is the median of the repeats; the aten ops of
one step are counted with a dispatch mode (all ops, `copy_`, `nonzero`, `bmm`).

    python -m benchmarks bench_logprob [--tokens 1024] [--hidden 896] [--vocab 151936] [--repeats 1]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import resource
import statistics
import time

VARIANTS = ("today", "fused (all rows)", "fused (response rows)")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _one(variant: str, tokens: int, hidden: int, vocab: int, repeats: int, queue) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparserl_mcore.loss.fused_logprob import linear_logprobs
    from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    b, s = 2, tokens // 2
    h_sbh = torch.randn(s, b, hidden, generator=gen).requires_grad_(True)
    weight = (0.02 * torch.randn(vocab, hidden, generator=gen)).requires_grad_(True)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    g_lp, g_h = torch.randn(b, s - 1, generator=gen), torch.randn(b, s - 1, generator=gen)
    rows = torch.arange(s // 2, s - 1)  # the response half: positions whose next token trains
    base = _peak_rss_mb()

    def step() -> None:
        h_sbh.grad = weight.grad = None
        if variant == "today":
            logits = torch.matmul(h_sbh, weight.t()).transpose(0, 1).contiguous()
            logp, ent = vocab_parallel_logprobs(
                logits[:, :-1], ids[:, 1:], group=None, vocab_start=0, temperature=0.8
            )
            ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
            return
        pos = torch.arange(s - 1) if variant == "fused (all rows)" else rows
        h = h_sbh.index_select(0, pos).reshape(-1, hidden)  # rows (t, i) in [s, b] order
        target = ids[:, 1:].t().index_select(0, pos).reshape(-1)
        logp, ent = linear_logprobs(h, weight, target, group=None, vocab_start=0, temperature=0.8)
        gl, gh = (g.t().index_select(0, pos).reshape(-1) for g in (g_lp, g_h))
        ((logp * gl).sum() + (ent * gh).sum()).backward()

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _peak_rss_mb() - base
    with Count() as counter:
        step()
    ops = counter.ops
    queue.put(
        (
            variant,
            peak,
            statistics.median(times),
            sum(ops.values()),
            ops["copy_"],
            ops["nonzero"],
            ops["bmm"],
        )
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_logprob", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (2 sequences)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = []
    for variant in VARIANTS:
        queue = ctx.Queue()
        proc = ctx.Process(
            target=_one, args=(variant, args.tokens, args.hidden, args.vocab, args.repeats, queue)
        )
        proc.start()
        results.append(queue.get())
        proc.join()
        if proc.exitcode != 0:
            print(f"{variant}: exit {proc.exitcode}")
            return 1
    today = results[0][1]
    print(
        f"\n{args.tokens} tokens (2 sequences), H={args.hidden}, V={args.vocab:,}, fp32, TP=1, 1 thread, "
        "fwd+bwd"
    )
    print(
        f"{'variant':<22} {'peak RSS +MiB':>13} {'x today':>8} {'s/step':>8} {'aten ops':>9} "
        f"{'copy_':>6} {'nonzero':>8} {'bmm':>4}"
    )
    for variant, peak, sec, ops, copies, nonzero, bmm in results:
        print(
            f"{variant:<22} {peak:>13.0f} {peak / today:>8.2f} {sec:>8.2f} {ops:>9} "
            f"{copies:>6} {nonzero:>8} {bmm:>4}"
        )
    return 0
