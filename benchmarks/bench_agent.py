"""Multi-turn episodes on the embedded engine: prompt tokens prefilled per turn, with and without
the finished-sequence radix insert, dense and with each turn recompressing the whole history.

A scripted environment answers every turn with a fixed observation (so every arm runs the same
token stream: same seeds, turns end by their cap), on a tiny random Qwen2 (CPU, fp32). Per turn k:
the request's prompt length (the whole trajectory so far), the tokens the radix cache supplied,
the tokens prefilled, and the most KV positions a request held.

    python -m benchmarks bench_agent [--turns 6] [--tokens-per-turn 24] [--episodes 32] [--page-size 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ARMS = {  # name -> (radix cache, KV compression)
    "dense, no radix": (False, None),
    "dense, radix": (True, None),
    "recompress (streamingllm 64), radix": (True, "streamingllm"),
}


def _arm(hf: Path, radix: bool, kv: str | None, args: argparse.Namespace) -> list[dict[str, float]]:
    from sparserl_mcore.agent import Env, EnvConfig, Reply, Turn
    from sparserl_mcore.agent.render import PlainRenderer
    from sparserl_mcore.agent.runner import EpisodeRunner, EpisodeSpec
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.rollout.protocol import SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.rollouts import request_seed

    class Scripted(Env):
        def reset(self, row):
            return row["prompt"]

        def step(self, turn: Turn) -> Reply:
            return Reply(observation=f"={turn.index % 10} r{args.turns - turn.index}\n")

    kv_cfg = KVCompressionConfig(method=kv, budget=64, interval=8, window=8) if kv else KVCompressionConfig()
    engine = EmbeddedEngine(
        hf,
        EngineConfig(
            device="cpu", dtype="float32", page_size=args.page_size, radix_cache=radix, kv_compression=kv_cfg
        ),
    )
    tok = engine.tokenizer
    runner = EpisodeRunner(
        EnginePool({"e0": engine}, PoolConfig(chunk_size=4)),
        Scripted,
        EnvConfig(
            name="bench",
            max_turns=args.turns,
            max_tokens_per_turn=args.tokens_per_turn,
            max_episode_tokens=4096,
        ),
        PlainRenderer(tok),
        lambda ids: tok.decode(list(ids)),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.tokens_per_turn, ignore_eos=True),
        context_length=2048,
        eos_token_ids=(tok.eos_token_id,),
        seed_of=lambda rid: request_seed(0, rid),
    )
    specs = [
        EpisodeSpec(rid=f"e{i}", row={"prompt": f"hop 3 from {i % 10}\n"}, group=f"g{i // 4}")
        for i in range(args.episodes)
    ]
    episodes = runner.run(specs)
    rows = []
    for k in range(args.turns):
        turns = [e.turns[k] for e in episodes]
        n = len(turns)
        rows.append(
            {
                "prompt": sum(len(t.prompt_ids) for t in turns) / n,
                "cached": sum(t.cached_prompt_tokens for t in turns) / n,
                "prefilled": sum(len(t.prompt_ids) - t.cached_prompt_tokens for t in turns) / n,
                "peak_kv": max(t.kv_stats.peak_retained_tokens for t in turns),
            }
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_agent", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens-per-turn", type=int, default=24)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny(
            TinyModelConfig(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128), Path(tmp) / "hf"
        )
        shape = f"{args.turns} turns of {args.tokens_per_turn} sampled tokens"
        print(f"{args.episodes} episodes x {shape}, page size {args.page_size}")
        print("per turn: mean prompt / from radix / prefilled tokens, most KV positions held")
        for name, (radix, kv) in ARMS.items():
            rows = _arm(hf, radix, kv, args)
            cells = "  ".join(
                f"t{k}: {r['prompt']:.0f}/{r['cached']:.0f}/{r['prefilled']:.0f} ({r['peak_kv']:.0f})"
                for k, r in enumerate(rows)
            )
            total = sum(r["prefilled"] for r in rows)
            print(f"{name:38s} prefilled per episode {total:6.1f} | {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
