"""Warm start of the demo policy: wall time, and task reward under greedy and sampled decoding.

Runs what `sparserl demo` runs first (trainer.warmstart.prepare_policy with the DEMO_* presets:
make-tiny Qwen2, running-sum task, supervised warm start), then decodes the held-out split with
HF transformers `generate` (dense KV, an implementation independent of our engine) and scores it
with the task's reward. The start reward has to be clearly above zero (GRPO needs reward variance
within groups) and well below one (room to rise).

    python -m benchmarks bench_warmstart [--out DIR] [--eval N] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_warmstart", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--eval", type=int, default=128, help="held-out prompts to decode")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the demo box has 2 cores)")
    args = parser.parse_args(argv)

    import torch

    from sparserl_mcore.rewards import running_sum_reward
    from sparserl_mcore.trainer.tasks import DEMO_TASK
    from sparserl_mcore.trainer.warmstart import DEMO_WARM_START, evaluate_reward, prepare_policy

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        start = time.perf_counter()
        policy = prepare_policy(
            out, n_eval=args.eval, log=lambda s, loss: print(f"  step {s:4d}  loss {loss:.3f}")
        )
        prepare_s = time.perf_counter() - start
        rows = [json.loads(line) for line in policy.eval_path.read_text().splitlines()]
        budget = DEMO_TASK.completion_tokens() + 4
        scores = {}
        for name, temperature in (("greedy", 0.0), ("sampled T=1", 1.0)):
            t0 = time.perf_counter()
            scores[name] = evaluate_reward(
                policy.model_dir, rows, running_sum_reward, max_new_tokens=budget, temperature=temperature
            )
            scores[f"{name} decode s"] = time.perf_counter() - t0
    result = policy.result
    print(
        f"task: {DEMO_TASK}, completion {DEMO_TASK.completion_tokens()} tokens; warm start: {DEMO_WARM_START}"
    )
    print("| steps | final loss | warm-start s | prepare s (data, make-tiny, train) | greedy | sampled T=1 |")
    print("|---|---|---|---|---|---|")
    steps = result.steps if result else "reused"
    loss = f"{result.final_loss:.3f}" if result else "-"
    train_s = f"{result.seconds:.0f}" if result else "-"
    print(
        f"| {steps} | {loss} | {train_s} | {prepare_s:.0f} | {scores['greedy']:.3f} "
        f"| {scores['sampled T=1']:.3f} |"
    )
    print(
        f"decode time for {len(rows)} prompts: greedy {scores['greedy decode s']:.0f} s, sampled "
        f"{scores['sampled T=1 decode s']:.0f} s"
    )
    return 0
