"""Sparse sync of an MoE policy vs a dense one: how many experts change per RL step, and the patch's
bytes per changed element.

Both policies are trained by the trainer's learner (megatron, bf16 params, fp32 Adam in the
distributed optimizer, one process on CPU) with GRPO updates on synthetic rollouts at an RL
learning rate, and synced the way the trainer syncs (`ShardSyncer.local_changes` +
`per_rank.encode_fragment`, the default `sub` + zstd codec). The MoE policy is a tiny Qwen3-MoE (E
experts, top-k); the dense one a Qwen3 of the same width whose MLP is as wide as the MoE's active
experts (top_k x expert width): the usual "same active parameters" comparison. Per step:
experts a token was routed to (from the routers' own counts), experts with at least one changed
element, the share of changed elements in expert and in dense tensors, and the patch bytes per
changed element. `--tokens` small leaves experts without tokens: their weights still move while
Adam's first moment decays.

    python -m benchmarks bench_moe_sync [--steps 6 --lr 1e-6 --tokens 512 --experts 16 --top-k 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def _policy(arch: str, out: Path, args: argparse.Namespace) -> Path:
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    common = dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seed=1, dtype="bfloat16")
    if arch == "qwen3_moe":
        cfg = TinyModelConfig(
            arch=arch, experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn, **common
        )
    else:
        cfg = TinyModelConfig(arch=arch, ffn=args.top_k * args.expert_ffn, **common)
    return make_tiny(cfg, out)


def _batch(step: int, tokens: int, vocab: int):
    """A synthetic GRPO batch of about `tokens` tokens: 8 sequences (4 below 64 tokens), each a
    prompt then a response (the second half)."""
    from sparserl_mcore.loss import grpo_advantages

    seqs = 8 if tokens >= 64 else 4
    length = max(4, tokens // seqs)
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (seqs, length), generator=gen)
    mask = torch.zeros(seqs, length)
    mask[:, length // 2 :] = 1
    advantages = grpo_advantages(torch.randint(0, 2, (seqs,), generator=gen).float(), 4)
    return ids, mask, advantages


def _run(hf_dir: Path, args: argparse.Namespace, rt) -> list[dict]:
    from model_providers.moe_config import MoEConfig
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.config import OptimizerConfig
    from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
    from sparserl_mcore.loss.megatron_step import UpdateBatch, UpdateConfig, compute_logprobs, train_on_batch
    from sparserl_mcore.sync.hashing import dtype_name
    from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer, build_sync_groups, runtime_ranges
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment
    from sparserl_mcore.trainer import learner, moe_routing

    spec, gpt = learner.build_model(str(hf_dir), "bf16", rt, moe=MoEConfig(load_balancing="none"))
    layout = layout_for(spec)
    load_hf_weights(gpt, layout, str(hf_dir), tp_rank=0, pp_rank=0)
    model = learner.wrap_ddp(gpt, spec, rt, distributed_optimizer=True)
    optimizer, _ = learner.build_optimizer(model, OptimizerConfig(lr=args.lr, weight_decay=0.0), spec, rt)
    owned = runtime_ranges(gpt, layout, rt)
    config = ShardSyncConfig(mirror=False)
    syncer = ShardSyncer(
        gpt, layout, tp_rank=0, pp_rank=0, groups=build_sync_groups(rt), owned=owned, config=config
    )
    meta = ModelMeta(dtype_name(torch.bfloat16), layout.hf_shapes)
    cfg = UpdateConfig(micro_batch_size=4, vocab_size=spec.vocab_size)
    experts = {n for n in layout.hf_shapes if ".mlp.experts." in n}
    rows = []
    for step in range(1, args.steps + 1):
        ids, mask, adv = _batch(step, args.tokens, spec.vocab_size)
        logp = compute_logprobs(
            model, ids, micro_batch_size=4, temperature=1.0, vocab_size=spec.vocab_size, runtime=rt
        )
        batch = UpdateBatch(tokens_BT=ids, mask_BT=mask, advantages_B=adv, logp_sparse_BT=logp * mask)
        train_on_batch(model, optimizer, batch, cfg=cfg, gate=DynamicGradientGate(DGGConfig()), runtime=rt)
        routing = moe_routing.collect(model, rt)
        changes = syncer.local_changes()
        patch = encode_fragment(changes, meta, version=step + 1, base_version=step, fragment=(0, 1))
        changed = {name: idx.size for name, idx, _, _ in changes}
        expert_keys = {n.rsplit(".", 2)[0] for n in changed if n in experts}  # model.layers.L.mlp.experts.E
        rows.append(
            {
                "step": step,
                "routed": int((routing.tokens_per_expert > 0).sum()) if routing is not None else 0,
                "experts_changed": len(expert_keys),
                "expert_frac": sum(changed.get(n, 0) for n in experts)
                / max(1, sum(int(np.prod(layout.hf_shapes[n])) for n in experts)),
                "dense_frac": sum(v for n, v in changed.items() if n not in experts)
                / sum(int(np.prod(s)) for n, s in layout.hf_shapes.items() if n not in experts),
                "changed": sum(changed.values()),
                "bytes": len(patch),
            }
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_moe_sync", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=64)
    args = parser.parse_args(argv)
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    torch.set_num_threads(1)
    total_experts = 2 * args.experts
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for arch in ("qwen3_moe", "qwen3"):
            rt = initialize(ParallelConfig(), seed=0)
            try:
                results[arch] = _run(_policy(arch, Path(tmp) / arch, args), args, rt)
            finally:
                shutdown()
    print(
        f"lr {args.lr:g}, {args.tokens} tokens per step, {args.experts} experts top-{args.top_k} x 2 layers"
    )
    print(
        "step | MoE: experts routed / changed | changed elements in experts / dense | bytes per changed "
        "| dense model: changed elements | bytes per changed"
    )
    for moe, dense in zip(results["qwen3_moe"], results["qwen3"], strict=True):
        print(
            f"{moe['step']:4d} | {moe['routed']:3d} / {moe['experts_changed']:3d} (of {total_experts})"
            f" | {moe['expert_frac']:7.3%} / {moe['dense_frac']:7.3%}"
            f" | {moe['bytes'] / max(1, moe['changed']):6.3f}"
            f" | {dense['dense_frac']:7.3%}"
            f" | {dense['bytes'] / max(1, dense['changed']):6.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
