"""Worker of tests/test_moe_train.py: GRPO updates of a tiny MoE policy with the product's learner.

    python tests/moe_train_worker.py OUT HF_DIR --tp T --ep E [--save CKPT | --resume CKPT]
    torchrun --nproc_per_node N tests/moe_train_worker.py ...   (N = the layout's world size)

The learner is the trainer's own (`trainer.learner`: megatron DDP, the distributed optimizer over
dense and expert parameters, Adam, grad clipping), fp32, aux loss on (coefficient 0.01). Two
rollout batches: a KL + entropy update (K=1), then K=2 epochs x 2 minibatches with Sparse-RL
correction (a vetoed sequence, rejected tokens) and DGG. Every DP rank gets the same micro-batches
a single process would split the batch into, so the per-micro-batch aux loss is the same too.
Rank 0 writes OUT/result.pt: every metric, DGG energy and routing table (tokens per expert per
layer), and OUT/hf: the trained policy exported as HF safetensors (the learner's own export).
`--save CKPT` saves a training checkpoint after the first batch; `--resume CKPT` loads it instead
of running the first batch (at this layout: the checkpoint may come from another EP / TP).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import torch
import torch.distributed as dist

from model_providers.moe_config import MoEConfig
from sparserl_mcore.ckpt.convert import export_hf
from sparserl_mcore.ckpt.hf_io import load_hf_weights
from sparserl_mcore.ckpt.layout import layout_for
from sparserl_mcore.config import OptimizerConfig
from sparserl_mcore.loss import CorrectionConfig, PolicyLossConfig, grpo_advantages
from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
from sparserl_mcore.loss.megatron_step import UpdateBatch, UpdateConfig, compute_logprobs, train_on_batch
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.trainer import checkpoint, learner, moe_routing
from sparserl_mcore.trainer.run_layout import RunLayout

B, T, GROUP, VOCAB = 8, 12, 4, 200
UPDATE_CFG = UpdateConfig(
    micro_batch_size=2,
    minibatches_per_epoch=2,
    epochs=2,
    temperature=0.8,
    vocab_size=VOCAB,
    policy=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01),
    correction=CorrectionConfig(),
)
MOE = MoEConfig(aux_loss_coeff=0.01)
OPTIMIZER = OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1e-6)


def rollout(seed: int) -> dict[str, torch.Tensor]:
    """A global batch: prompts of 3-5 tokens, responses of 2-7, right-padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (B, T), generator=gen)
    mask = torch.zeros(B, T)
    for row in range(B):
        p, n = 3 + row % 3, 2 + (row * 5 + seed) % 6
        mask[row, p : p + n] = 1
        tokens[row, p + n :] = 0
    delta = 0.1 * torch.randn(B, T, generator=gen)  # log(pi_old / pi_sparse) per token
    delta[1, 5], delta[2, 6], delta[6, 5] = -1.0, 0.8, -12.0  # two rejected tokens, one veto
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    rewards[0] = 1.0 - rewards[1]
    return {
        "tokens": tokens,
        "mask": mask,
        "delta": delta,
        "advantages": grpo_advantages(rewards, GROUP),
        "ref_shift": 0.05 * torch.randn(B, T, generator=gen),
    }


def local_batch(data: dict, model, rt, *, with_ref: bool) -> UpdateBatch:
    """This DP rank's share of every minibatch (the single process's micro-batches, split)."""
    per_mb = B // UPDATE_CFG.minibatches_per_epoch
    share = per_mb // rt.dp_size
    rows = torch.cat(
        [
            torch.arange(j * per_mb + rt.dp_rank * share, j * per_mb + (rt.dp_rank + 1) * share)
            for j in range(2)
        ]
    )
    tokens = data["tokens"][rows]
    logp_old = compute_logprobs(
        model, tokens, micro_batch_size=2, temperature=UPDATE_CFG.temperature, vocab_size=VOCAB, runtime=rt
    )
    logp_old = torch.zeros(tokens.shape) if logp_old is None else logp_old
    mask = data["mask"][rows]
    return UpdateBatch(
        tokens_BT=tokens,
        mask_BT=mask,
        advantages_B=data["advantages"][rows],
        logp_sparse_BT=(logp_old - data["delta"][rows]) * mask,
        logp_ref_BT=(logp_old + data["ref_shift"][rows]) * mask if with_ref else None,
    )


def update(model, optimizer, scheduler, rt, *, seed: int, cfg: UpdateConfig, with_ref: bool) -> dict:
    res = train_on_batch(
        model,
        optimizer,
        local_batch(rollout(seed), model, rt, with_ref=with_ref),
        cfg=cfg,
        gate=DynamicGradientGate(DGGConfig()),
        runtime=rt,
        scheduler=scheduler,
    )
    routing = moe_routing.collect(model, rt)
    assert routing is not None
    return {
        "metrics": res.metrics,
        "updates": res.updates,
        "energies": [d.energy for d in res.decisions],
        "routing": routing.tokens_per_expert,
        "aux_loss": routing.aux_loss,
        "routing_metrics": routing.metrics(),
    }


def layout_record(rt, spec) -> RunLayout:
    return RunLayout(
        world_size=rt.world_size,
        tensor_model_parallel_size=rt.tp_size,
        pipeline_model_parallel_size=rt.pp_size,
        params_dtype="fp32",
        distributed_optimizer=True,
        padded_vocab_size=spec.padded_vocab_size,
        expert_model_parallel_size=rt.ep_size,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    par = ParallelConfig(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    rt = initialize(par, seed=7)
    out = pathlib.Path(args.out)
    spec, gpt = learner.build_model(args.hf_dir, "fp32", rt, moe=MOE)
    load_hf_weights(
        gpt, layout_for(spec), args.hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank, ep_rank=rt.ep_rank
    )
    model = learner.wrap_ddp(gpt, spec, rt, distributed_optimizer=True)
    optimizer, scheduler = learner.build_optimizer(model, OPTIMIZER, spec, rt)
    result = {"steps": []}
    one = dataclasses.replace(UPDATE_CFG, minibatches_per_epoch=1, epochs=1)
    if args.resume:
        checkpoint.load_checkpoint(
            pathlib.Path(args.resume),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            layout=layout_record(rt, spec),
            seed=7,
            pp_rank=rt.pp_rank,
        )
    else:
        result["steps"].append(update(model, optimizer, scheduler, rt, seed=1, cfg=one, with_ref=True))
    if args.save:
        record = {"config": {}, "world_size": rt.world_size, "data": {}, "layout": layout_record(rt, spec)}
        checkpoint.save_checkpoint(
            args.save,
            1,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loop_state={"step": 1},
            record=record,
        )
    result["steps"].append(update(model, optimizer, scheduler, rt, seed=2, cfg=UPDATE_CFG, with_ref=False))
    if rt.rank == 0:
        (out / "hf").mkdir(parents=True)
    dist.barrier()
    export_hf(learner.unwrap_model(model), spec, rt, out / "hf", hf_config_dir=args.hf_dir)
    if rt.rank == 0:
        torch.save(result, out / "result.pt")
    shutdown()


if __name__ == "__main__":
    main()
