"""Warm start of the demo policy: wall time, task reward, and which part of the rule it got right.

Runs what `sparserl demo` runs first (trainer.warmstart.prepare_policy with the DEMO_* presets:
make-tiny Qwen2, digit-chain task with slipped demonstrations, supervised warm start), then decodes
the held-out split with HF transformers `generate` (dense KV, an implementation independent of our
engine), scores it with the task's reward and counts, over the digits each completion wrote, the
steps that apply the rule right: non-carry steps, carry steps, and carry steps written with the
demonstrations' slip. The demo needs a policy whose greedy answers are mostly wrong (room for the
greedy eval to rise) and whose samples find the right carry often enough for GRPO to prefer it.
Then the same prompts through the EmbeddedEngine, dense and under KV compression at several
budgets: how hard the budget bites on this task before any RL (every digit needs only the two
before it, so recent-window eviction keeps it solvable; score-based eviction may not keep the
most recent positions it needs).

    python -m benchmarks bench_warmstart                 # defaults
    python -m benchmarks.bench_warmstart [--out DIR] [--eval N] [--seed S]
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
    parser.add_argument(
        "--seed", type=int, default=0, help="prepare_policy's seed (as `sparserl demo --seed`)"
    )
    args = parser.parse_args(argv)

    from sparserl_mcore.rewards import digit_chain_reward
    from sparserl_mcore.trainer.tasks import DEMO_TASK
    from sparserl_mcore.trainer.warmstart import DEMO_WARM_START, generate_completions, prepare_policy

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        start = time.perf_counter()
        policy = prepare_policy(
            out,
            n_eval=args.eval,
            seed=args.seed,
            log=lambda s, loss: print(f"  step {s:4d}  loss {loss:.3f}"),
        )
        prepare_s = time.perf_counter() - start
        rows = [json.loads(line) for line in policy.eval_path.read_text().splitlines()]
        budget = DEMO_TASK.completion_tokens() + 2
        hf = {}
        for name, temperature in (("greedy", 0.0), ("T=1", 1.0)):
            texts = generate_completions(
                policy.model_dir, [r["prompt"] for r in rows], max_new_tokens=budget, temperature=temperature
            )
            reward = sum(digit_chain_reward(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(
                rows
            )
            hf[name] = (reward, *rule_steps(texts, rows, DEMO_TASK.lag))
        kv_rows = _kv_budget_rewards(policy.model_dir, rows, budget)
    result = policy.result
    print(f"task: {DEMO_TASK}; warm start: {DEMO_WARM_START}, seed {args.seed}")
    print("| steps | final loss | warm-start s | prepare s (all) |\n|---|---|---|---|")
    if result:
        print(f"| {result.steps} | {result.final_loss:.3f} | {result.seconds:.0f} | {prepare_s:.0f} |")
    else:
        print(f"| reused | - | - | {prepare_s:.0f} |")
    print("| HF generate, dense | reward | non-carry steps right | carry steps right | carry steps slipped |")
    print("|---|---|---|---|---|")
    for name, (reward, plain, carry, slip) in hf.items():
        print(f"| {name} | {reward:.3f} | {plain:.3f} | {carry:.3f} | {slip:.3f} |")
    print("| engine KV | budget | peak KV bytes / request | greedy | sampled T=1 |")
    print("|---|---|---|---|---|")
    for row in kv_rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 0


def rule_steps(texts: list[str], rows: list[dict], lag: int) -> tuple[float, float, float]:
    """How the completions apply the chain rule to their own previous digits: the share of
    non-carry steps (x[t-1] + x[t-lag] < 10) written right, of carry steps written right, and of
    carry steps written with the demonstrations' slip (one too many)."""
    counts = {"plain": [0, 0], "carry": [0, 0], "slip": [0, 0]}
    for text, row in zip(texts, rows, strict=True):
        given = row["prompt"].split()[-1]
        digits = [int(c) for c in given + "".join(c for c in text if c.isdigit())]
        for t in range(len(given), len(digits)):
            total = digits[t - 1] + digits[t - lag]
            kind = "carry" if total >= 10 else "plain"
            counts[kind][0] += digits[t] == total % 10
            counts[kind][1] += 1
            counts["slip"][0] += kind == "carry" and digits[t] == (total + 1) % 10
            counts["slip"][1] += kind == "carry"
    plain, carry, slip = (ok / max(n, 1) for ok, n in counts.values())
    return plain, carry, slip


# (method, budget): dense, StreamingLLM at shrinking budgets (the demo's: examples/demo.yaml), and the
# score-based policies at the demo's budget. Sequences are up to 38 positions (prompt 8-12, 24
# digits + EOS, a token of slack).
KV_SETTINGS = (
    ("none", 0),
    ("streamingllm", 20),
    ("streamingllm", 16),
    ("streamingllm", 12),
    ("snapkv", 16),
    ("rkv", 16),
    ("h2o", 16),
)


def engine_reward(
    model_dir: Path, rows: list[dict], kv, temperature: float, max_new_tokens: int, reward=None
) -> tuple[float, int]:
    """Mean reward (default: digit chain) of `rows` decoded by the EmbeddedEngine (KV compression
    `kv`, None = dense; seeded per prompt), and the largest peak KV bytes of a request."""
    from sparserl_mcore.rewards import digit_chain_reward
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.trainer.warmstart import torch_threads

    engine = EmbeddedEngine(model_dir, EngineConfig(device="cpu", kv_compression=kv or KVCompressionConfig()))
    tok = engine.tokenizer
    reqs = [
        GenerateRequest(
            input_ids=tok(r["prompt"], add_special_tokens=False)["input_ids"],
            sampling=SamplingParams(
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_token_ids=(tok.eos_token_id,),
                seed=i,
            ),
        )
        for i, r in enumerate(rows)
    ]
    with torch_threads(1):
        samples = engine.generate(reqs)
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in samples]
    reward = reward or digit_chain_reward
    score = sum(reward(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)
    return score, max(s.kv_stats.peak_kv_bytes for s in samples)


def _kv_budget_rewards(model_dir: Path, rows: list[dict], max_new_tokens: int) -> list[tuple]:
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

    out = []
    for method, budget in KV_SETTINGS:
        kv = None
        if method != "none":  # the demo's settings (examples/demo.yaml)
            kv = KVCompressionConfig(
                method=method, budget=budget, interval=4, window=4, kernel_size=3, sink_tokens=4
            )
        greedy, peak = engine_reward(model_dir, rows, kv, 0.0, max_new_tokens)
        sampled, peak_sampled = engine_reward(model_dir, rows, kv, 1.0, max_new_tokens)
        peak = max(peak, peak_sampled)
        out.append((method, budget or "-", f"{peak:,}", f"{greedy:.3f}", f"{sampled:.3f}"))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
