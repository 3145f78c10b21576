"""Worker of tests/test_moe_train.py: GRPO updates of a tiny MoE policy with the product's learner.

    python tests/moe_train_worker.py OUT HF_DIR --tp T --ep E [--save CKPT | --resume CKPT]
    torchrun --nproc_per_node N tests/moe_train_worker.py ...   (N = the layout's world size)

The learner is the trainer's own (`trainer.learner`: megatron DDP, the distributed optimizer over
dense and expert parameters, Adam, grad clipping), fp32, aux loss on (coefficient 0.01). Two
rollout batches of tests/loss_dist_worker.py's scenario: a KL + entropy update (K=1), then K=2
epochs x 2 minibatches with Sparse-RL correction (a vetoed sequence, rejected tokens) and DGG.
Every DP rank gets the same micro-batches a single process would split the batch into, so the
per-micro-batch aux loss is the same too.
Rank 0 writes OUT/result.pt: every metric, DGG energy and routing table (tokens per expert per
layer), and OUT/hf: the trained policy exported as HF safetensors (the learner's own export).
`--save CKPT` saves a training checkpoint after the first batch; `--resume CKPT` loads it instead
of running the first batch (at this layout: the checkpoint may come from another EP / TP).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import torch
import torch.distributed as dist

from model_providers.moe_config import MoEConfig
from sparserl_mcore.ckpt.convert import export_hf
from sparserl_mcore.ckpt.hf_io import load_hf_weights
from sparserl_mcore.ckpt.layout import layout_for
from sparserl_mcore.config import OptimizerConfig
from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
from sparserl_mcore.loss.megatron_step import UpdateConfig, train_on_batch
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.trainer import checkpoint, learner, moe_routing
from sparserl_mcore.trainer.run_layout import RunLayout

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# the dense distributed-update test's scenario (batch of 8, vocab 100, 2 micro-batches of 2 per
# minibatch), each DP rank taking its share of every minibatch
from loss_dist_worker import UPDATE_CFG, local_batch, rollout  # noqa: E402

MOE = MoEConfig(aux_loss_coeff=0.01)
OPTIMIZER = OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1e-6)


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
