"""Per-token log-prob + entropy (forward + backward): full log_softmax vs chunked vocab-parallel.

Each variant runs in a fresh spawned process; peak memory is that process's peak RSS growth over
the inputs (logits, targets) already allocated, time is the median of the repeats. TP = 1 here:
the comparison is about the chunking (fp32 temporaries [chunk, V] instead of [N, V]); with TP > 1
every number per rank scales with V / TP.

    python -m benchmarks bench_loss [--tokens 2048] [--vocab 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

VARIANTS = (
    "log_softmax",
    "vocab_parallel chunk=all",
    "vocab_parallel chunk=1024",
    "vocab_parallel chunk=256",
)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _one(variant: str, tokens: int, vocab: int, repeats: int, queue) -> None:
    import torch

    from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    base = _peak_rss_mb()

    def step() -> None:
        logits.grad = None
        if variant == "log_softmax":
            logp_all = torch.log_softmax(logits.float() / 0.8, dim=-1)
            logp = logp_all.gather(-1, target[:, None]).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
        else:
            chunk = tokens if variant.endswith("all") else int(variant.rsplit("=", 1)[1])
            logp, ent = vocab_parallel_logprobs(
                logits, target, group=None, vocab_start=0, temperature=0.8, chunk_tokens=chunk
            )
        (logp.sum() + 0.01 * ent.sum()).backward()

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    queue.put((statistics.median(times), _peak_rss_mb() - base))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_loss", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for variant in VARIANTS:
        queue = ctx.Queue()
        proc = ctx.Process(target=_one, args=(variant, args.tokens, args.vocab, args.repeats, queue))
        proc.start()
        seconds, peak_mb = queue.get()
        proc.join()
        rows.append((variant, seconds, peak_mb))
    logits_mb = args.tokens * args.vocab * 2 / 2**20
    print(
        f"tokens={args.tokens} vocab={args.vocab} bf16 logits {logits_mb:.0f} MiB, T=0.8, fwd+bwd, 1 thread"
    )
    print(f"| variant | ms (median of {args.repeats}) | peak RSS growth MiB | x logits size |")
    print("|---|---:|---:|---:|")
    for variant, seconds, peak_mb in rows:
        print(f"| {variant} | {seconds * 1e3:.0f} | {peak_mb:.0f} | {peak_mb / logits_mb:.1f} |")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
