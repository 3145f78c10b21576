"""Warm start of the demo policy: wall time, and task reward under greedy and sampled decoding.

Runs what `sparserl demo` runs first (trainer.warmstart.prepare_policy with the DEMO_* presets:
make-tiny Qwen2, digit-chain task, supervised warm start), then decodes the held-out split with
HF transformers `generate` (dense KV, an implementation independent of our engine) and scores it
with the task's reward. The start reward has to be clearly above zero (GRPO needs reward variance
within groups) and well below one (room to rise). Then the same prompts through the
EmbeddedEngine, dense and under KV compression at several budgets: how hard the budget bites
on this task before any RL (every digit needs only the two before it, so recent-window eviction
should keep it solvable; score-based eviction may not keep the most recent positions it needs).

    python -m benchmarks bench_warmstart                 # defaults
    python -m benchmarks.bench_warmstart [--out DIR] [--eval N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_warmstart", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--eval", type=int, default=128, help="held-out prompts to decode")
    args = parser.parse_args(argv)

    from sparserl_mcore.rewards import digit_chain_reward
    from sparserl_mcore.trainer.tasks import DEMO_TASK
    from sparserl_mcore.trainer.warmstart import DEMO_WARM_START, evaluate_reward, prepare_policy

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
                policy.model_dir, rows, digit_chain_reward, max_new_tokens=budget, temperature=temperature
            )
            scores[f"{name} decode s"] = time.perf_counter() - t0
        kv_rows = _kv_budget_rewards(policy.model_dir, rows, budget)
    result = policy.result
    print(
        f"task: {DEMO_TASK}, completion {DEMO_TASK.completion_tokens()} tokens; warm start: {DEMO_WARM_START}"
    )
    print("| steps | final loss / exact match | warm-start s | prepare s (all) | greedy | sampled T=1 |")
    print("|---|---|---|---|---|---|")
    steps = result.steps if result else "reused"
    loss = f"{result.final_loss:.3f} / {result.final_accuracy:.2f}" if result else "-"
    train_s = f"{result.seconds:.0f}" if result else "-"
    print(
        f"| {steps} | {loss} | {train_s} | {prepare_s:.0f} | {scores['greedy']:.3f} "
        f"| {scores['sampled T=1']:.3f} |"
    )
    print(
        f"decode time for {len(rows)} prompts: greedy {scores['greedy decode s']:.1f} s, sampled "
        f"{scores['sampled T=1 decode s']:.1f} s"
    )
    print("| engine KV | budget | peak KV bytes / request | greedy | sampled T=1 |")
    print("|---|---|---|---|---|")
    for row in kv_rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 0


# (method, budget): dense, StreamingLLM at shrinking budgets (the demo's: 20), and the score-based
# policies at the demo's budget. Sequences are ~46 positions (prompt 8-12, 40 digits + EOS).
KV_SETTINGS = (
    ("none", 0),
    ("streamingllm", 24),
    ("streamingllm", 20),
    ("streamingllm", 16),
    ("snapkv", 20),
    ("rkv", 20),
    ("h2o", 20),
)


def _kv_budget_rewards(model_dir: Path, rows: list[dict], max_new_tokens: int) -> list[tuple]:
    from sparserl_mcore.rewards import digit_chain_reward
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.trainer.warmstart import torch_threads

    out = []
    for method, budget in KV_SETTINGS:
        kv = KVCompressionConfig()
        if method != "none":  # the demo's settings (examples/demo.yaml)
            kv = KVCompressionConfig(
                method=method, budget=budget, interval=4, window=4, kernel_size=3, sink_tokens=4
            )
        engine = EmbeddedEngine(model_dir, EngineConfig(device="cpu", kv_compression=kv))
        tok = engine.tokenizer
        scores, peak = [], 0
        for temperature in (0.0, 1.0):
            sampling = [
                SamplingParams(
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=(tok.eos_token_id,),
                    seed=i,
                )
                for i in range(len(rows))
            ]
            reqs = [
                GenerateRequest(
                    input_ids=tok(r["prompt"], add_special_tokens=False)["input_ids"], sampling=sp
                )
                for r, sp in zip(rows, sampling, strict=True)
            ]
            with torch_threads(1):
                samples = engine.generate(reqs)
            texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in samples]
            scores.append(
                sum(digit_chain_reward(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)
            )
            peak = max(peak, *(s.kv_stats.peak_kv_bytes for s in samples))
        out.append((method, budget or "-", f"{peak:,}", f"{scores[0]:.3f}", f"{scores[1]:.3f}"))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
