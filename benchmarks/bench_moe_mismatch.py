"""Train/rollout mismatch of an MoE policy against a dense one, and how much of it routing causes.

The sampler is the embedded engine (bf16, its paged decode path), the learner megatron (bf16
params, the trainer's log-prob recompute `compute_logprobs`), both from the same HF checkpoint:
what a synchronous RL step sees before any update. Per model: |log pi_learner - log pi_sampler|
over the sampled response tokens (mean, p99, max) and the K3 KL estimate the Sparse-RL correction
logs. For the MoE policy also the routing disagreement: the sampler's expert choices are recorded
per token and layer (`CausalLM.record_routing`, one request at a time so the engine's rows are the
tokens in order) and compared with the learner's (`routing_replay.MergingReplay.recorded`), and
the mismatch is split into tokens whose routing agreed in every layer and tokens with at least one
layer routed differently; then recomputed with the sampler's choices replayed in the learner
(`compute_logprobs(routed_BTLK=...)`, the trainer's R3 path): what rollout routing replay removes.

`--sampler sglang`: the sampler is a live SGLang 0.5.23 server on CPU instead (`sparserl
sglang-serve --device cpu`, one per policy, `--return-routed-experts` for the MoE one; SGLang's own
models, bf16), read through the trainer's `SGLangWorker`; the expert choices are the ones SGLang
returns (`meta_info["routed_experts"]`), the ids the trainer replays.

    python -m benchmarks bench_moe_mismatch [--samples 16 --new-tokens 48 --experts 16 --top-k 4]
        [--sampler embedded|sglang]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.sglang_cpu import cpu_server


def _policies(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    common = dict(layers=4, hidden=128, heads=4, kv_heads=2, vocab=512, dtype="bfloat16", seed=2)
    moe = TinyModelConfig(arch="qwen3_moe", experts=args.experts, top_k=args.top_k, expert_ffn=64, **common)
    dense = TinyModelConfig(arch="qwen3", ffn=args.top_k * 64, **common)
    return {"moe": make_tiny(moe, root / "moe"), "dense": make_tiny(dense, root / "dense")}


def _sample(hf_dir: Path, args: argparse.Namespace):
    """Engine samples (one request at a time) with their sampler log-probs and, for MoE, the
    sampler's expert choices per token: [layers, tokens, k]."""
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", dtype="bfloat16", seed=0))
    moe = engine.model.cfg.moe is not None
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    out = []
    gen = torch.Generator().manual_seed(5)
    for i in range(args.samples):
        prompt = torch.randint(3, 500, (12,), generator=gen).tolist()
        log: list[list[torch.Tensor]] = []
        engine.model.record_routing(log if moe else None)  # each forward's choices, in call order
        engine.flush_cache()
        params = dataclasses.replace(sampling, seed=i)
        sample = engine.generate([GenerateRequest(input_ids=tuple(prompt), sampling=params)])[0]
        routing = None
        if moe:
            routing = torch.stack([torch.cat([step[layer] for step in log]) for layer in range(len(log[0]))])
        out.append((sample, routing))
    return out


# SGLang's CPU engine on a small shared box: a 4096-token KV pool, no warm-up request, and the
# served weights labelled version 0 (the trainer's client reads samples of synced versions only)
SGLANG_FLAGS = ("--max-total-tokens", "4096", "--mem-fraction-static", "0.8", "--skip-server-warmup")


def _sample_sglang(hf_dir: Path, args: argparse.Namespace):
    """`_sample` with a live SGLang server as the sampler; the MoE policy's choices are the ids
    SGLang returns: [layers, tokens, k]."""
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.trainer.routing_replay import RoutingShape

    shape = RoutingShape.of_checkpoint(hf_dir)
    moe = shape is not None
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    out = []
    gen = torch.Generator().manual_seed(5)
    log = hf_dir.parent / f"{hf_dir.name}-sglang.log"
    routed = ["--return-routed-experts"] if moe else []
    flags = (*SGLANG_FLAGS, "--weight-version", "0")
    with cpu_server(hf_dir, log, serve_args=routed, sglang_args=flags) as url:
        worker = SGLangWorker(url, routed_experts_shape=(shape.layers, shape.top_k) if shape else None)
        for i in range(args.samples):
            prompt = torch.randint(3, 500, (12,), generator=gen).tolist()
            params = dataclasses.replace(sampling, seed=i)
            request = GenerateRequest(input_ids=tuple(prompt), sampling=params, return_routed_experts=moe)
            (sample,) = worker.generate([request])
            routing = None
            if moe:
                if sample.routed_experts is None:
                    raise RuntimeError(f"{url} returned no routed experts for sample {i}")
                routing = sample.routed_experts.long().transpose(0, 1)  # [layers, tokens, k]
            out.append((sample, routing))
        worker.close()
    return out


def _learner(hf_dir: Path, rt):
    from model_providers import build_model, build_spec
    from model_providers.moe_config import MoEConfig
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for

    spec = build_spec(hf_dir, rt.parallel, params_dtype="bfloat16", moe=MoEConfig(routing_replay=True))
    model = build_model(spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups)
    load_hf_weights(model, layout_for(spec), hf_dir, tp_rank=0, pp_rank=0)
    return spec, model.eval()


def _recompute(model, spec, rt, tokens: torch.Tensor, replay: torch.Tensor | None):
    """Learner log-probs of one sequence [1, T]; with `replay` [layers, T, k] the routers take those
    choices; returns (logp [T], the learner's own choices [layers, T, k] or None)."""
    from model_providers.routing_replay import routers
    from sparserl_mcore.loss.megatron_step import compute_logprobs

    found = routers(model)
    logp = compute_logprobs(
        model,
        tokens,
        micro_batch_size=1,
        temperature=1.0,
        vocab_size=spec.vocab_size,
        runtime=rt,
        routed_BTLK=None if replay is None else replay.transpose(0, 1)[None],
    )
    chosen = None if replay is not None or not found else torch.stack([r.recorded for _, r in found])
    return logp[0], chosen


def _stats(diff: np.ndarray) -> str:
    if diff.size == 0:
        return "     -      -      -       -"
    kl = np.mean(np.exp(-diff) - 1 + diff)  # K3 with log ratio learner - sampler
    a = np.abs(diff)
    return f"{a.mean():.4f} {np.quantile(a, 0.99):.4f} {a.max():.4f} {kl:.2e}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_moe_mismatch", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument(
        "--sampler", choices=("embedded", "sglang"), default="embedded", help="sglang: a live CPU server"
    )
    args = parser.parse_args(argv)
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, hf_dir in _policies(Path(tmp), args).items():
            samples = _sample_sglang(hf_dir, args) if args.sampler == "sglang" else _sample(hf_dir, args)
            rt = initialize(ParallelConfig(), seed=0)
            try:
                spec, model = _learner(hf_dir, rt)
                rows.append((name, _measure(model, spec, rt, samples)))
            finally:
                shutdown()
    sampler = "SGLang 0.5.23, CPU" if args.sampler == "sglang" else "embedded engine"
    print(f"{args.samples} samples x {args.new_tokens} tokens, bf16 sampler ({sampler}) vs bf16 learner")
    print("policy / tokens                          | mean|d| p99|d|  max|d|  K3 KL")
    for name, result in rows:
        for label, diff in result.items():
            print(f"{name:6s} {label:34s} | {_stats(diff)}")
    return 0


def _measure(model, spec, rt, samples) -> dict[str, np.ndarray]:
    """Per-token log-ratio learner - sampler on response tokens, split by routing agreement."""
    diffs, agreed, disagreed, replayed, flips, pairs = [], [], [], [], 0, 0
    for sample, routing in samples:
        ids = list(sample.prompt_ids) + list(sample.output_ids)
        tokens = torch.tensor([ids])
        logp, chosen = _recompute(model, spec, rt, tokens, None)
        n_prompt, n_out = len(sample.prompt_ids), len(sample.output_ids)
        learner = logp[n_prompt : n_prompt + n_out].float().numpy()
        diff = learner - np.asarray(sample.output_logprobs, dtype=np.float64)
        diffs.append(diff)
        if routing is None:
            continue
        inputs = len(ids) - 1  # the sampler routed every token it fed in (all but the last)
        same = (chosen[:, :inputs].sort(-1).values == routing[:, :inputs].sort(-1).values).all(-1)  # [L, T]
        flips += int((~same).sum())
        pairs += same.numel()
        # the response token at position p was scored from the states of tokens < p
        clean = torch.stack([same[:, : n_prompt + j].all() for j in range(n_out)]).numpy()
        agreed.append(diff[clean])
        disagreed.append(diff[~clean])
        full = torch.cat([routing, chosen[:, inputs:]], dim=1)  # the last token: the learner's own
        replay_logp, _ = _recompute(model, spec, rt, tokens, full)
        replayed.append(
            replay_logp[n_prompt : n_prompt + n_out].float().numpy() - np.asarray(sample.output_logprobs)
        )
    out = {"all response tokens": np.concatenate(diffs)}
    if pairs:
        print(f"routing: {flips} of {pairs} (token, layer) choices differ ({flips / pairs:.3%})")
        out["routing agreed in every layer"] = np.concatenate(agreed)
        out["routing differed in some layer"] = np.concatenate(disagreed)
        out["with the sampler's routing replayed"] = np.concatenate(replayed)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
