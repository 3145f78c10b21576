"""torchrun worker for tests/test_loss_distributed.py: the RL update on one or more layouts.

    python -m torch.distributed.run --nproc_per_node N tests/loss_dist_worker.py TP PP HF_DIR=OUT_FILE
    python tests/loss_dist_worker.py 1 1 HF_DIR=OUT_FILE [HF_DIR=OUT_FILE ...]     (single process)

DP = N / (TP * PP). Rank 0 writes OUT_FILE (torch.save) with: the metrics of every update, the DGG
energies, and the full (DP-reduced, TP-gathered, PP-merged, global names) gradients of the first
update. With --oracle the log-probs come from megatron's output layer + vocab_parallel_logprobs
instead of the fused head (UpdateConfig.fused_logprob). With --spike it also runs the DGG spike
scenario and records every rank's decisions.
Several runs in one process only without torchrun (re-initialising inside a torchrun job hangs).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from safetensors.torch import load_file

import model_providers
from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.loss import CorrectionConfig, PolicyLossConfig, grpo_advantages
from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
from sparserl_mcore.loss.lm_head_grad import leaf_optimizers, lm_head_weight
from sparserl_mcore.loss.megatron_step import UpdateBatch, UpdateConfig, compute_logprobs, train_on_batch
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

B, T, GROUP, VOCAB = 8, 12, 4, 100
LR = 1e-3
CHECKED = (
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.1.mlp.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
UPDATE_CFG = UpdateConfig(
    micro_batch_size=2,
    minibatches_per_epoch=2,
    epochs=2,
    temperature=0.8,
    vocab_size=VOCAB,
    policy=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01),
    correction=CorrectionConfig(),
)


def rollout(seed: int) -> dict[str, torch.Tensor]:
    """A global batch: prompts of 3-5 tokens, responses of 2-7, right-padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (B, T), generator=gen)
    mask = torch.zeros(B, T)
    for row in range(B):
        p = 3 + row % 3
        n = 2 + (row * 5 + seed) % 6
        mask[row, p : p + n] = 1
        tokens[row, p + n :] = 0
    # log xi = log(pi_old / pi_sparse) per token: mostly small, a few rejected, one veto.
    delta = 0.1 * torch.randn(B, T, generator=gen)
    delta[1, 5] = -1.0  # xi = e^-1 < 0.5: rejected
    delta[2, 6] = 0.8  # xi = e^0.8 > 1.5: rejected
    delta[6, 5] = -12.0  # xi ~ 6e-6 < 1e-4: sequence 6 vetoed
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    rewards[0] = 1.0 - rewards[1]  # at least one informative group
    advantages = grpo_advantages(rewards, GROUP)
    ref_shift = 0.05 * torch.randn(B, T, generator=gen)
    return {"tokens": tokens, "mask": mask, "delta": delta, "advantages": advantages, "ref_shift": ref_shift}


def load_hf(model: torch.nn.Module, spec, runtime, hf_dir: str) -> None:
    state = load_file(str(pathlib.Path(hf_dir) / "model.safetensors"))
    layout = ModelLayout(
        spec.hf, tp_size=runtime.tp_size, pp_size=runtime.pp_size, padded_vocab_size=spec.padded_vocab_size
    )
    shard = layout.shard(runtime.tp_rank, runtime.pp_rank)

    def read(name, rows, cols):
        t = state[name][rows]
        return t if cols is None else t[:, cols]

    with torch.no_grad():
        for name, param in model.named_parameters():
            layout.fill_local(shard[name], param.data, read)


def build(hf_dir: str, runtime):
    """fp32 model + megatron Adam; the distributed optimizer needs CUDA tensors, so not on CPU."""
    spec = model_providers.build_spec(hf_dir, runtime.parallel, params_dtype="float32", cpu=True)
    gpt = model_providers.build_model(
        spec,
        device=runtime.device,
        pre_process=runtime.is_first_stage,
        post_process=runtime.is_last_stage,
        pg_collection=runtime.groups,
    )
    load_hf(gpt, spec, runtime, hf_dir)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    model = DistributedDataParallel(spec.config, ddp_cfg, gpt, pg_collection=runtime.groups)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=LR,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(
        opt_cfg, [model], use_gloo_process_groups=False, pg_collection=runtime.groups
    )
    return model, optimizer


def local_batch(data: dict, model, runtime, *, with_ref: bool) -> UpdateBatch:
    """This DP rank's rows, with logp_sparse (and logp_ref) derived from the current pi_old."""
    # Minibatch j of the global batch is rows [j*B/M, (j+1)*B/M); each DP rank takes its share of
    # every minibatch, so the global minibatches match the single-process run's.
    per_mb = B // UPDATE_CFG.minibatches_per_epoch
    share = per_mb // runtime.dp_size
    rows = torch.cat(
        [
            torch.arange(j * per_mb + runtime.dp_rank * share, j * per_mb + (runtime.dp_rank + 1) * share)
            for j in range(UPDATE_CFG.minibatches_per_epoch)
        ]
    )
    tokens = data["tokens"][rows]
    logp_old = compute_logprobs(
        model,
        tokens,
        micro_batch_size=2,
        temperature=UPDATE_CFG.temperature,
        vocab_size=VOCAB,
        runtime=runtime,
        fused=UPDATE_CFG.fused_logprob,
    )
    if logp_old is None:  # not the last stage: these tensors are never read there
        logp_old = torch.zeros(tokens.shape)
    mask = data["mask"][rows]
    return UpdateBatch(
        tokens_BT=tokens,
        mask_BT=mask,
        advantages_B=data["advantages"][rows],
        logp_sparse_BT=(logp_old - data["delta"][rows]) * mask,
        logp_ref_BT=(logp_old + data["ref_shift"][rows]) * mask if with_ref else None,
    )


def global_name(name: str, runtime, layers_per_stage: int) -> str:
    def shift(m: re.Match) -> str:
        return f"decoder.layers.{runtime.pp_rank * layers_per_stage + int(m.group(1))}."

    return re.sub(r"^decoder\.layers\.(\d+)\.", shift, name)


def reduced_grad(param, optimizer, runtime) -> torch.Tensor:
    """The DP-reduced gradient of a local param; with the distributed optimizer each DP rank holds
    only its owned range, so the ranges are summed over DP."""
    grad = param.main_grad.detach().clone()
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, DistributedOptimizer):
            owned = torch.zeros_like(grad).view(-1)
            if param in leaf.model_param_gbuf_map:
                r = leaf._get_model_param_range_map(param)["param"]
                owned[r.start : r.end] = grad.view(-1)[r.start : r.end]
            dist.all_reduce(owned, group=runtime.groups.dp)
            return owned.view_as(grad)
    return grad


def full_grads(model, optimizer, runtime, layers_per_stage: int) -> dict[str, torch.Tensor]:
    """Gradients of CHECKED params as TP=1 tensors with global names, merged over PP, on every rank."""
    local = {}
    for name, param in model.module.named_parameters():
        gname = global_name(name, runtime, layers_per_stage)
        if gname not in CHECKED or (
            gname == "output_layer.weight" and model.module.share_embeddings_and_output_weights
        ):
            continue  # a tied model's last-stage copy: the embedding's gradient is checked instead
        tensor = reduced_grad(param, optimizer, runtime)
        if getattr(param, "tensor_model_parallel", False) and runtime.tp_size > 1:
            parts = [torch.empty_like(tensor) for _ in range(runtime.tp_size)]
            dist.all_gather(parts, tensor, group=runtime.groups.tp)
            tensor = torch.cat(parts, dim=param.partition_dim)
        if "word_embeddings" in gname or "output_layer" in gname:
            tensor = tensor[:VOCAB]  # padding rows differ per layout
        local[gname] = tensor
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, local)
    return {k: v for d in gathered for k, v in d.items()}


def dwd_groups(model) -> dict[str, list[torch.Tensor]]:
    """Copies of the DWD groups of a single-process model, picked by parameter name: the lm_head
    (the embedding when tied) and the decoder layers [L//4, L - L//4)."""
    gpt = model.module
    n = gpt.config.num_layers
    head = (
        "embedding.word_embeddings.weight"
        if gpt.share_embeddings_and_output_weights
        else "output_layer.weight"
    )
    middle = tuple(f"decoder.layers.{i}." for i in range(n // 4, n - n // 4))
    params = dict(gpt.named_parameters())
    return {
        "lm_head": [params[head].detach().clone()],
        "middle": [p.detach().clone() for name, p in params.items() if name.startswith(middle)],
    }


def rel_change(before: dict, after: dict) -> dict[str, float]:
    out = {}
    for name in before:
        delta = sum(
            float((a.double() - b.double()).square().sum())
            for a, b in zip(after[name], before[name], strict=True)
        )
        norm = sum(float(b.double().square().sum()) for b in before[name])
        out[name] = (delta / norm) ** 0.5
    return out


def run_layout(hf_dir: str, out_file: pathlib.Path, tp: int, pp: int, spike: bool) -> None:
    runtime = initialize(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=7
    )
    model, optimizer = build(hf_dir, runtime)
    layers_per_stage = model.module.config.num_layers // runtime.pp_size
    result = {"updates": [], "energies": [], "metrics": []}

    # 1. one update (K=1, one minibatch); the reduced grads stay in main_grad until the next update.
    one = dataclasses.replace(UPDATE_CFG, minibatches_per_epoch=1, epochs=1)
    gate = DynamicGradientGate(DGGConfig())
    before = dwd_groups(model) if runtime.world_size == 1 else None
    res = train_on_batch(
        model,
        optimizer,
        local_batch(rollout(1), model, runtime, with_ref=True),
        cfg=one,
        gate=gate,
        runtime=runtime,
    )
    result["grads"] = full_grads(model, optimizer, runtime, layers_per_stage)
    if before is not None:
        result["dwd_by_hand"] = rel_change(before, dwd_groups(model))
    result["metrics"].append(res.metrics)
    result["updates"] += res.updates
    result["energies"] += [d.energy for d in res.decisions]

    # 2. K=2 epochs x 2 minibatches (4 updates, window never full: no gating), no reference.
    gate = DynamicGradientGate(DGGConfig())
    res = train_on_batch(
        model,
        optimizer,
        local_batch(rollout(2), model, runtime, with_ref=False),
        cfg=UPDATE_CFG,
        gate=gate,
        runtime=runtime,
    )
    result["metrics"].append(res.metrics)
    result["updates"] += res.updates
    result["energies"] += [d.energy for d in res.decisions]

    if spike:
        result["spike"] = spike_scenario(model, optimizer, runtime)
    if runtime.rank == 0:
        torch.save(result, out_file)
    shutdown()


# Applied-update indices (the scheduler's step count) whose lm_head gradient is multiplied by 30:
# the first pass of rollout batch 2 (k=1: must NOT gate) and the second pass of batch 3 (k=2: gates).
SPIKE_STEPS = (3, 7)


def spike_scenario(model, optimizer, runtime) -> dict:
    """3 rollout batches, K=3, window 3 (filled by batch 1): constructed lm_head spikes at k=1, k=2."""
    gate = DynamicGradientGate(DGGConfig(window=3, tau=0.5))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=LR,
        max_lr=LR,
        min_lr=LR,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    if runtime.is_last_stage:
        lm_head_weight(model).register_hook(lambda g: g * 30.0 if scheduler.num_steps in SPIKE_STEPS else g)
    cfg = dataclasses.replace(UPDATE_CFG, minibatches_per_epoch=1, epochs=3)
    batches = []
    for seed in (3, 4, 5):
        res = train_on_batch(
            model,
            optimizer,
            local_batch(rollout(seed), model, runtime, with_ref=False),
            cfg=cfg,
            gate=gate,
            runtime=runtime,
            scheduler=scheduler,
        )
        batches.append([(d.reuse_index, d.gate, d.z, d.energy) for d in res.decisions])
    everyone = [None] * runtime.world_size
    dist.all_gather_object(everyone, batches)
    applied = sum(1 for b in batches for (_, g, _, _) in b if not g)
    return {"decisions": everyone, "scheduler_steps": scheduler.num_steps, "applied": applied}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tp", type=int)
    parser.add_argument("pp", type=int)
    parser.add_argument("runs", nargs="+", help="HF_DIR=OUT_FILE; several only without torchrun")
    parser.add_argument("--spike", action="store_true")
    parser.add_argument("--oracle", action="store_true", help="the output layer's logits path")
    args = parser.parse_args()
    global UPDATE_CFG
    UPDATE_CFG = dataclasses.replace(UPDATE_CFG, fused_logprob=not args.oracle)
    torch.set_num_threads(1)
    for run in args.runs:
        hf_dir, out_file = run.split("=", 1)
        run_layout(hf_dir, pathlib.Path(out_file), args.tp, args.pp, args.spike)


if __name__ == "__main__":
    main()
