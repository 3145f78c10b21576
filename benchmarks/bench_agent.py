"""Multi-turn episodes on the embedded engine: prompt tokens prefilled per turn, with and without
the finished-sequence radix insert, dense and with each turn recompressing the whole history; with
`--env lookup_chain`, the KV modes by turn count on the built-in task instead.

Prefill study: a scripted environment answers every turn with a fixed observation (so every arm runs the same
token stream: same seeds, turns end by their cap), on a tiny random Qwen2 (CPU, fp32). Per turn k:
the request's prompt length (the whole trajectory so far), the tokens the radix cache supplied,
the tokens prefilled, and the most KV positions a request held.

    python -m benchmarks bench_agent [--turns 6] [--tokens-per-turn 24] [--episodes 32] [--page-size 16]

KV-mode study (`--env lookup_chain`): the demo's tiny Qwen2 warm-started on lookup_chain
demonstrations (`prepare_lookup_policy`, about 25 s, reused from --work) samples the same episodes
(same rows, same per-turn seeds) dense and with each turn recompressing the whole history under a
StreamingLLM budget. Per arm: reward, policy turns, the most KV positions a turn attended over per
episode (its prefill included: under recompress each turn prefills the whole history), the most it
held when a turn finished, and, against dense log-probs of the whole episode row (HF transformers, fp32:
what the learner recomputes), the Sparse-RL veto rate (default thresholds) and mismatch KL, by the
episode's turn count and per turn index.

    python -m benchmarks bench_agent --env lookup_chain [--episodes 512] [--budgets 24,16] [--work DIR]
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


def _lookup_arm(policy, rows: list[dict], kv: str | None, budget: int):
    """The episodes of one KV arm on lookup_chain (group of 4 episodes per row)."""
    from sparserl_mcore.agent import EnvConfig, resolve_env
    from sparserl_mcore.agent.render import PlainRenderer
    from sparserl_mcore.agent.runner import EpisodeRunner, EpisodeSpec
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.rollout.protocol import SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.rollouts import request_seed

    kv_cfg = KVCompressionConfig()
    if kv:
        kv_cfg = KVCompressionConfig(method=kv, budget=budget, interval=4, window=4, sink_tokens=4)
    engine = EmbeddedEngine(
        policy,
        EngineConfig(device="cpu", dtype="float32", page_size=4, radix_cache=True, kv_compression=kv_cfg),
    )
    tok = engine.tokenizer
    runner = EpisodeRunner(
        EnginePool({"e0": engine}, PoolConfig(chunk_size=64)),
        resolve_env("lookup_chain"),
        EnvConfig(name="lookup_chain", max_turns=5, max_tokens_per_turn=8, max_episode_tokens=80),
        PlainRenderer(tok),
        lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        context_length=512,
        eos_token_ids=(tok.eos_token_id,),
        seed_of=lambda rid: request_seed(0, rid),
    )
    specs = [
        EpisodeSpec(rid=f"p{i}-g{j}", row=row, group=f"p{i}") for i, row in enumerate(rows) for j in range(4)
    ]
    return runner.run(specs)


def _dense_logprobs(policy, batch):
    """log pi(token t) of every row under the dense policy (HF transformers, fp32, temperature 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, torch_dtype=torch.float32).eval()
    out = torch.zeros_like(batch.logp_sparse_BT)
    with torch.no_grad():
        for rows in torch.arange(batch.size).split(64):
            logits = model(batch.tokens_BT[rows]).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            out[rows, 1:] = logp.gather(-1, batch.tokens_BT[rows, 1:, None]).squeeze(-1)
    return out * batch.mask_BT


def _vetoed(logp_old, batch, cfg):
    """Per row: did Sparse-RL's veto drop it (each row corrected on its own)."""
    import torch

    from sparserl_mcore.loss.correction import sparse_rl_correction

    def one(r: int) -> bool:
        rows = slice(r, r + 1)
        metrics = sparse_rl_correction(logp_old[rows], batch.logp_sparse_BT[rows], batch.mask_BT[rows], cfg)[
            2
        ]
        return bool(metrics["correction/vetoed_sequences"])

    return torch.tensor([one(r) for r in range(batch.size)])


def _held(turn) -> int:
    """KV positions a turn held when it finished: its sequence but the last sampled token (never
    fed), less what compression evicted."""
    return len(turn.prompt_ids) + len(turn.output_ids) - 1 - turn.kv_stats.evictions


def _report(name: str, episodes, logp_old, batch, dense_peak: float | None) -> float:
    """Print one arm's lines; returns its mean peak KV positions per episode."""
    import torch

    from sparserl_mcore.loss.correction import (
        CorrectionConfig,
        sparse_rl_correction,
        turn_metrics,
        turn_pieces,
    )
    from sparserl_mcore.loss.totals import reduce_metrics

    cfg = CorrectionConfig()
    vetoed = _vetoed(logp_old, batch, cfg)
    kl = float(
        sparse_rl_correction(logp_old, batch.logp_sparse_BT, batch.mask_BT, cfg)[2]["correction/mismatch_kl"]
    )
    pieces = turn_pieces(logp_old, batch.logp_sparse_BT, batch.mask_BT, batch.turn_BT, 5, cfg)
    per_turn = turn_metrics(reduce_metrics([pieces]), 5)
    peak = torch.tensor([float(max(t.kv_stats.peak_retained_tokens for t in e.turns)) for e in episodes])
    held = torch.tensor([float(max(_held(t) for t in e.turns)) for e in episodes])
    turns = torch.tensor([len(e.turns) for e in episodes])
    ratio = peak.mean().item() / (dense_peak or peak.mean().item())
    print(
        f"{name}: reward {batch.rewards_B.mean():.3f}, turns {turns.float().mean():.2f}, "
        f"peak KV positions per episode {peak.mean():.1f} (max {peak.max():.0f}, {ratio:.2f}x dense), "
        f"held at a turn's end {held.mean():.1f} (max {held.max():.0f}), "
        f"vetoed {vetoed.float().mean():.3f}, mismatch KL {kl:.4f}"
    )
    for n in sorted(set(turns.tolist())):
        at = turns == n
        print(
            f"    {n} turns: {int(at.sum()):4d} episodes, reward {batch.rewards_B[at].mean():.3f}, "
            f"vetoed {vetoed[at].float().mean():.3f}, peak KV {peak[at].mean():.1f}, "
            f"held {held[at].mean():.1f}"
        )
    cells = [
        f"t{k}: KL {per_turn[f'correction/mismatch_kl_turn{k}']:.4f} "
        f"veto {per_turn[f'correction/veto_frac_turn{k}']:.3f}"
        for k in range(5)
        if f"correction/mismatch_kl_turn{k}" in per_turn
    ]
    print(f"    per turn index: {'  '.join(cells)}")
    return peak.mean().item()


def kv_modes(args: argparse.Namespace) -> None:
    """See the module docstring (KV-mode study)."""
    import json

    from sparserl_mcore.trainer.batch import build_batch
    from sparserl_mcore.trainer.warmstart import prepare_lookup_policy

    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare_lookup_policy(args.work or tmp)
        lines = prepared.train_path.read_text().splitlines()
        rows = [json.loads(line) for line in lines[: args.episodes // 4]]
        arms = [("dense", None, 0)] + [
            (f"recompress streamingllm {b}", "streamingllm", b) for b in args.budgets
        ]
        print(f"lookup_chain: {4 * len(rows)} episodes ({len(rows)} rows x 4), at most 5 turns of 8 tokens")
        dense_peak = None
        for name, kv, budget in arms:
            episodes = _lookup_arm(prepared.model_dir, rows, kv, budget)
            batch = build_batch(episodes, [e.reward for e in episodes], group_size=4, normalize_std=True)
            logp_old = _dense_logprobs(prepared.model_dir, batch)
            peak = _report(name, episodes, logp_old, batch, dense_peak)
            dense_peak = dense_peak or peak


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_agent", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens-per-turn", type=int, default=24)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--env", choices=["lookup_chain"], help="the KV-mode study on this env instead")
    parser.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")], default=[24, 16])
    parser.add_argument("--work", help="KV-mode study: where the warm-started policy is kept (reused)")
    args = parser.parse_args(argv)
    if args.env:
        if args.episodes == 32:  # the prefill study's default
            args.episodes = 512
        kv_modes(args)
        return 0
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
