"""`sparserl serve` over loopback: what HTTP costs vs the in-process engine, and weight updates.

Same random-weight model (bf16 safetensors, sparserl_mcore.ckpt.tiny) and prompts for every row;
one warm-up then one timed run each:
1. generated tokens/s: `EmbeddedEngine.generate` in-process vs the same batch through
   `RemoteEngine` -> `sparserl serve` (subprocess; in-process runs before and after, the ratio is to
   their mean), vs the same prompts as concurrent single-prompt
   HTTP requests from separate client threads (they join one continuous batch in the server);
2. weight update through the routes: a sparse patch touching `--changed` of every tensor's
   elements (/update_weights_from_patch) vs the full model as safetensors
   (/update_weights_from_safetensors): request bytes and seconds.

`python -m benchmarks bench_serve [--gen 128] ...`; results in docs/benchmarks.md ("## Serve").
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.client import RemoteEngine
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

TOKEN = "bench-serve-token"


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_serve", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen", type=int, default=128, help="generated tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, in-process and in the server")
    p.add_argument("--changed", type=float, default=0.01, help="fraction of elements a patch changes")
    return p.parse_args(argv)


def _requests(prompts: list[list[int]], gen: int) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0.0, max_new_tokens=gen, ignore_eos=True)
    return [GenerateRequest(input_ids=p, sampling=params) for p in prompts]


def _tps(generate, prompts: list[list[int]], gen: int) -> float:
    generate(_requests(prompts[:2], 8))  # warm-up
    start = time.perf_counter()
    samples = generate(_requests(prompts, gen))
    return sum(len(s.output_ids) for s in samples) / (time.perf_counter() - start)


def _concurrent_tps(remote: RemoteEngine, prompts: list[list[int]], gen: int) -> float:
    """One HTTP request per prompt, all in flight at once from separate threads."""
    remote.generate(_requests(prompts[:1], 8))  # warm-up
    counts: list[int] = []
    threads = [
        threading.Thread(
            target=lambda p=p: counts.append(len(remote.generate(_requests([p], gen))[0].output_ids))
        )
        for p in prompts
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


@contextmanager
def _server(hf_dir: str, threads: int) -> Iterator[str]:
    cmd = [sys.executable, "-m", "sparserl_mcore", "serve", "--hf-dir", hf_dir, "--port", "0",
           "--token", TOKEN, "--device", "cpu", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        yield lines.get(timeout=300).rsplit(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(60)


def _weight_updates(remote: RemoteEngine, hf_dir: str, changed: float) -> list[tuple[str, int, float]]:
    from safetensors.torch import load_file, save

    from sparserl_mcore.sync.codec import encode_patch
    from sparserl_mcore.sync.diff import make_patch

    old = {k: v for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    gen = torch.Generator().manual_seed(0)
    new = {}
    for name, t in old.items():
        mask = torch.rand(t.shape, generator=gen) < changed
        new[name] = torch.where(mask, t + 0.01 * torch.randn(t.shape, generator=gen).to(t.dtype), t)
    patch = encode_patch(make_patch(old, new, version=1, base_version=0, anchor_version=0))
    start = time.perf_counter()
    remote.apply_patch(patch)
    sparse_s = time.perf_counter() - start
    full_bytes = len(save(new))
    start = time.perf_counter()
    remote.update_weights(new, version=2)
    full_s = time.perf_counter() - start
    return [("sparse patch", len(patch), sparse_s), ("full safetensors", full_bytes, full_s)]


def main(argv: list[str]) -> int:
    args = _args(argv)
    # Same thread count on both sides: on a busy machine, OpenMP spinning with more threads than
    # free cores slows the main thread by 10x+, which would swamp what HTTP costs.
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = TinyModelConfig(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=2,
                               ffn=4 * args.hidden, vocab=args.vocab, dtype="bfloat16")  # fmt: skip
        hf_dir = str(make_tiny(tiny, os.path.join(tmp, "model")))
        engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu"))
        local_before = _tps(engine.generate, prompts, args.gen)
        with _server(hf_dir, args.threads) as url, RemoteEngine(url, token=TOKEN) as remote:
            batch_http = _tps(remote.generate, prompts, args.gen)
            concurrent_http = _concurrent_tps(remote, prompts, args.gen)
            updates = _weight_updates(remote, hf_dir, args.changed)
        local_after = _tps(engine.generate, prompts, args.gen)  # before/after brackets machine drift
    local = (local_before + local_after) / 2
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.batch} prompts x "
        f"{args.prompt_len} tokens, {args.gen} generated each, greedy, CPU, {args.threads} torch thread(s)"
    )
    print(f"{'generation':<40} {'tokens/s':>10} {'vs in-process':>14}")
    for label, tps in [
        ("EmbeddedEngine in-process, first run", local_before),
        ("EmbeddedEngine in-process, last run", local_after),
        ("HTTP, one batch request", batch_http),
        (f"HTTP, {args.batch} concurrent requests", concurrent_http),
    ]:
        print(f"{label:<40} {tps:>10.1f} {tps / local:>13.2f}x")
    print(f"{'weight update over HTTP':<40} {'bytes':>10} {'seconds':>14}")
    for label, size, seconds in updates:
        print(f"{label:<40} {size:>10} {seconds:>14.3f}")
    print(f"(sparse patch changes {args.changed:.0%} of the elements)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
