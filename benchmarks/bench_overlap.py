"""How far two pinned processes can overlap on this machine: the ceiling of asynchronous RL here.

    python -m benchmarks.bench_overlap [--seconds 10] [--rounds 3] [--out runs/overlap]

bench_async's loop section runs the learner on core 0 and the rollout server on core 1. Async RL
overlaps the two; it can gain at most (G + U + S) / max(G', U' + S'), where G and U are the
generation and update times of the synchronous loop and G', U' the same work while the other side
runs. This measures that slowdown outside the loop, on fixed work: each workload alone on its
core for --seconds, then both at once; median seconds per iteration, rounds interleaved.

  update    the demo learner (warm start of seed 0, TP=1, one torch thread) on core 0: pi_old
            log-probs and one `train_on_batch` of a fixed 64 x 40 batch, what a loop step repeats
  generate  128 requests (16 prompts x G=8, the demo's sampling, no early stop) to `sparserl serve`
            with the demo's KV compression on core 1, the client beside it
  python    a pure-Python integer loop on each core: the control. It stays in registers and L1, so
            a slowdown of it means the two vCPUs share execution resources on the host (SMT
            siblings, frequency), not the memory system
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PAIRS = {"python": (("python", "0"), ("python", "1")), "loop": (("update", "0"), ("generate", "1"))}
PROMPT_LEN, BATCH = 14, 64


def _python_work() -> Callable[[], object]:
    return lambda: sum(i * i for i in range(300_000))


def _update_work(policy: Path) -> Callable[[], object]:
    import torch

    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.demo import demo_config
    from sparserl_mcore.loss import megatron_step
    from sparserl_mcore.parallel import ParallelConfig, initialize
    from sparserl_mcore.trainer.setup import build_learner

    cfg = config_from_dict(demo_config(policy, None, 1), [])
    runtime = initialize(ParallelConfig(), seed=0)
    learner = build_learner(cfg, runtime)
    vocab = learner.update_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (BATCH, PROMPT_LEN + cfg.rollout.sampling.max_new_tokens), generator=g)
    mask = torch.ones(tokens.shape)
    mask[:, :PROMPT_LEN] = 0
    advantages = torch.randn(BATCH, generator=g)

    def step() -> object:
        logp = megatron_step.compute_logprobs(
            learner.model, tokens, micro_batch_size=cfg.train.micro_batch_size, temperature=1.0,
            vocab_size=vocab, runtime=runtime,
        )  # fmt: skip
        batch = megatron_step.UpdateBatch(
            tokens_BT=tokens, mask_BT=mask, advantages_B=advantages, logp_sparse_BT=logp * mask
        )
        return megatron_step.train_on_batch(
            learner.model, learner.optimizer, batch, cfg=learner.update_cfg, gate=learner.gate,
            runtime=runtime, scheduler=learner.scheduler,
        )  # fmt: skip

    return step


def _generate_work(policy: Path, url: str) -> Callable[[], object]:
    import torch

    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.demo import demo_config
    from sparserl_mcore.rollout.client import RemoteEngine
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    cfg = config_from_dict(demo_config(policy, None, 1), [])
    sampling = SamplingParams(
        temperature=cfg.rollout.sampling.temperature, max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        ignore_eos=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 90, (PROMPT_LEN,), generator=g).tolist()) for _ in range(16)]
    group = cfg.rollout.group_size
    requests = [GenerateRequest(input_ids=p, sampling=sampling) for p in prompts for _ in range(group)]
    engine = RemoteEngine(url)
    return lambda: engine.generate(requests)


def worker(kind: str, policy: Path, url: str, seconds: float) -> None:
    """Warm up, say READY, wait for a line on stdin, then iterate for `seconds`; print the times."""
    import torch

    torch.set_num_threads(1)
    work = {
        "python": _python_work,
        "update": lambda: _update_work(policy),
        "generate": lambda: _generate_work(policy, url),
    }
    once = work[kind]()
    once()
    print("READY", flush=True)
    sys.stdin.readline()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)


def _together(jobs: list[tuple[str, str]], a: argparse.Namespace, url: str) -> list[float]:
    """Median seconds per iteration of each (kind, core) job, all started at the same moment.
    Workers' library warnings go to OUT/worker-<kind>-<core>.log, not the console."""
    procs = []
    for kind, core in jobs:
        cmd = ["taskset", "-c", core, sys.executable, "-m", "benchmarks.bench_overlap", "--worker", kind,
               "--policy", str(a.policy), "--url", url, "--seconds", str(a.seconds)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(a.out / f"worker-{kind}-{core}.log", "w") as log:
            pipe = subprocess.PIPE
            procs.append(subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=log, text=True, env=env))
    for p in procs:  # every worker built and warm before any starts timing
        assert p.stdout is not None and p.stdin is not None
        if not any(line.strip() == "READY" for line in p.stdout):
            raise RuntimeError(f"bench_overlap worker {p.args} exited with {p.wait()} before it was ready")
    for p in procs:
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    medians = [statistics.median(json.loads(p.stdout.readline())) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"bench_overlap worker {p.args} exited with {p.returncode}")
    return medians


def measure(a: argparse.Namespace, url: str) -> dict[str, list[dict]]:
    """Per pair, `--rounds` rounds of (each alone, both together), interleaved because this VM's
    speed drifts over minutes; the median over rounds of each median."""
    results: dict[str, list[dict]] = {}
    for pair, jobs in PAIRS.items():
        rounds = [
            ([_together([job], a, url)[0] for job in jobs], _together(list(jobs), a, url))
            for _ in range(a.rounds)
        ]
        results[pair] = []
        for i, (kind, core) in enumerate(jobs):
            alone = statistics.median(r[0][i] for r in rounds)
            both = statistics.median(r[1][i] for r in rounds)
            ratios = [r[1][i] / r[0][i] for r in rounds]
            results[pair].append(
                {"work": kind, "core": core, "alone_s": alone, "together_s": both, "slowdown": both / alone,
                 "slowdown_per_round": ratios}
            )  # fmt: skip
    return results


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per measurement")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (alone, together) per pair")
    p.add_argument("--out", type=Path, default=Path("runs/overlap"), help="warm start and results.json")
    p.add_argument("--worker", choices=("python", "update", "generate"), help=argparse.SUPPRESS)
    p.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from benchmarks.bench_async import _server
    from sparserl_mcore.config import load_config
    from sparserl_mcore.demo import DEMO_YAML
    from sparserl_mcore.telemetry.console import quiet_library_output
    from sparserl_mcore.trainer.warmstart import prepare_policy

    a = _args(argv)
    quiet_library_output()
    if a.worker:
        worker(a.worker, a.policy, a.url, a.seconds)
        return 0
    a.out = a.out.resolve()
    a.policy = a.out / "seed0"
    model_dir = prepare_policy(a.policy, n_eval=64, seed=0).model_dir
    kv = dict(load_config(DEMO_YAML).rollout.kv.__dict__)
    with _server(model_dir, kv) as url:
        results = measure(a, url)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print("| pair | work | core | alone s/iter | together s/iter | slowdown | per round |")
    print("|---|---|---|---|---|---|---|")
    for pair, rows in results.items():
        for r in rows:
            per_round = ", ".join(f"{x:.2f}" for x in r["slowdown_per_round"])
            times = f"{r['alone_s']:.4f} | {r['together_s']:.4f} | {r['slowdown']:.2f}x | {per_round}"
            print(f"| {pair} | {r['work']} | {r['core']} | {times} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
