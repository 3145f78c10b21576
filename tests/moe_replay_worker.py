"""Worker of tests/test_moe_replay.py: the learner's expert choices with and without rollout routing
replay, on a batch the embedded engine sampled.

    python tests/moe_replay_worker.py OUT HF_DIR BATCH [--tp T --ep E --pp P]   (or under torchrun)

BATCH (torch.save) holds the trainer's rollout batch pieces: tokens_BT, mask_BT, lengths_B,
advantages_B, logp_sparse_BT, routed_BTLK. Every rank feeds the whole batch (one micro-batch).
The choices each router made in its last forward (`MergingReplay.recorded`, [s_local * b, k] in
megatron's token order) are saved per run, in OUT/rank{R}.pt:
- "free": the learner's own routing (pi_old recompute, no replay);
- "perturbed": the same after a small noise on every router's weights;
- "replayed": the perturbed learner's pi_old recompute with the engine's ids replayed;
- "trained": the training pass of one GRPO update (`train_on_batch`, the ids in the batch), plus
  how far the routers moved in it (the aux loss and the policy loss still train them).
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from model_providers.moe_config import MoEConfig
from model_providers.routing_replay import routers
from sparserl_mcore.ckpt.hf_io import load_hf_weights
from sparserl_mcore.ckpt.layout import layout_for
from sparserl_mcore.config import OptimizerConfig
from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
from sparserl_mcore.loss.megatron_step import UpdateBatch, UpdateConfig, compute_logprobs, train_on_batch
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.trainer import learner

NOISE = 0.05  # routers are drawn at N(0, 0.2) (ckpt.tiny): enough to flip some near choices


def recorded(model) -> dict[int, torch.Tensor]:
    return {layer: replay.recorded.clone() for layer, replay in routers(model)}


def router_weights(model) -> dict[int, torch.Tensor]:
    return {m.layer_number - 1: m.weight for m in model.modules() if hasattr(m, "router_replay")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("hf_dir")
    parser.add_argument("batch")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    par = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep,
        pipeline_model_parallel_size=args.pp,
    )
    rt = initialize(par, seed=7)
    data = torch.load(args.batch, weights_only=False)
    spec, gpt = learner.build_model(
        args.hf_dir, "fp32", rt, moe=MoEConfig(aux_loss_coeff=0.01, routing_replay=True)
    )
    load_hf_weights(
        gpt, layout_for(spec), args.hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank, ep_rank=rt.ep_rank
    )
    model = learner.wrap_ddp(gpt, spec, rt, distributed_optimizer=True)
    optimizer, scheduler = learner.build_optimizer(
        model, OptimizerConfig(lr=1e-2, weight_decay=0.0, eps=1e-6), spec, rt
    )
    tokens, b = data["tokens_BT"], data["tokens_BT"].shape[0]

    def recompute(routed: torch.Tensor | None) -> dict[int, torch.Tensor]:
        compute_logprobs(
            model, tokens, micro_batch_size=b, temperature=1.0, vocab_size=spec.vocab_size, runtime=rt,
            routed_BTLK=routed,
        )  # fmt: skip
        return recorded(model)

    runs = {"free": recompute(None)}
    with torch.no_grad():
        for layer, weight in sorted(router_weights(model).items()):  # the same noise on every rank
            g = torch.Generator().manual_seed(100 + layer)
            weight.add_(NOISE * torch.randn(weight.shape, generator=g).to(weight.dtype))
    runs["perturbed"] = recompute(None)
    runs["replayed"] = recompute(data["routed_BTLK"])
    before = {k: w.detach().clone() for k, w in router_weights(model).items()}
    batch = UpdateBatch(
        tokens_BT=tokens,
        mask_BT=data["mask_BT"],
        advantages_B=data["advantages_B"],
        logp_sparse_BT=data["logp_sparse_BT"],
        lengths_B=data["lengths_B"],
        routed_BTLK=data["routed_BTLK"],
    )
    cfg = UpdateConfig(micro_batch_size=b, vocab_size=spec.vocab_size)
    train_on_batch(
        model,
        optimizer,
        batch,
        cfg=cfg,
        gate=DynamicGradientGate(DGGConfig()),
        runtime=rt,
        scheduler=scheduler,
    )
    runs["trained"] = recorded(model)
    moved = {k: float((w.detach() - before[k]).norm()) for k, w in router_weights(model).items()}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"tp_rank": rt.tp_rank, "runs": runs, "router_moved": moved}, out / f"rank{rt.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
