"""Shared pieces of the multi-rank learner workers: a real RL update, and the learner's weights and
optimizer state gathered into HF coordinates (so states at different TP/PP/DP layouts compare).

The gathering is independent of megatron's checkpoint code: each rank reads its own distributed-
optimizer ranges (fp32 master weights and Adam moments), the DP ranks sum their disjoint ranges
into whole TP-local tensors, and `ckpt.layout.hf_pieces` places those in HF tensors on rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rl_update(learner, rt, seed: int) -> dict:
    """One trainer update (`megatron_step.train_on_batch`) on random tokens; the sampler log-probs
    are the current policy's, so the Sparse-RL correction vetoes nothing."""
    from sparserl_mcore.loss import megatron_step

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 90, (8, 16), generator=g)
    rows = torch.arange(8).tensor_split(rt.dp_size)[rt.dp_rank]
    tokens = tokens[rows]
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, :4] = 0
    cfg = learner.update_cfg
    logp = megatron_step.compute_logprobs(
        learner.model,
        tokens,
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature,
        vocab_size=cfg.vocab_size,
        runtime=rt,
    )
    if rt.pp_size > 1:  # the last stage computed them; every stage takes the same batch
        logp = _from_last_stage(logp, tokens.shape, rt)
    batch = megatron_step.UpdateBatch(
        tokens_BT=tokens,
        mask_BT=mask,
        advantages_B=torch.randn(8, generator=g)[rows],
        logp_sparse_BT=logp.cpu() * mask,
    )
    result = megatron_step.train_on_batch(
        learner.model,
        learner.optimizer,
        batch,
        cfg=cfg,
        gate=learner.gate,
        runtime=rt,
        scheduler=learner.scheduler,
    )
    return result.metrics


def _from_last_stage(logp, shape, rt) -> torch.Tensor:
    buf = logp.float().cpu() if logp is not None else torch.zeros(shape)
    src = dist.get_global_rank(rt.groups.pp, rt.pp_size - 1)
    dist.broadcast(buf, src=src, group=rt.groups.pp)
    return buf


def optimizer_state_hf(learner, rt) -> dict[str, dict[str, torch.Tensor]] | None:
    """{"master" | "exp_avg" | "exp_avg_sq": {hf_name: fp32 tensor}} on rank 0 (None elsewhere),
    from megatron's distributed optimizer (one leaf, torch Adam)."""
    from sparserl_mcore.loss.lm_head_grad import leaf_optimizers
    from sparserl_mcore.sync.learner import distributed_optimizer_ranges, mcore_name
    from sparserl_mcore.trainer.learner import unwrap_model

    (leaf,) = leaf_optimizers(learner.optimizer)
    core = unwrap_model(learner.model)
    ranges = distributed_optimizer_ranges(leaf, core)
    full = {kind: {} for kind in ("master", "exp_avg", "exp_avg_sq")}
    for name, param in core.named_parameters():
        name = mcore_name(name)
        start, end = ranges[name]
        state = {kind: torch.zeros(param.numel(), dtype=torch.float32) for kind in full}
        if end > start:
            group, order = leaf.model_param_group_index_map[param]
            main = leaf.optimizer.param_groups[group]["params"][order]
            adam = leaf.optimizer.state[main]
            state["master"][start:end] = main.detach().cpu()
            state["exp_avg"][start:end] = adam["exp_avg"].cpu()
            state["exp_avg_sq"][start:end] = adam["exp_avg_sq"].cpu()
        for kind, flat in state.items():
            dist.all_reduce(flat, group=rt.groups.dp)  # disjoint ranges: the sum is the whole param
            full[kind][name] = flat.view(param.shape)
    found = {kind: _to_hf(learner.layout, tensors, rt) for kind, tensors in full.items()}
    return found if rt.rank == 0 else None


def model_hf(learner, rt) -> dict[str, torch.Tensor] | None:
    """The learner's parameters (their own dtype) in HF coordinates on rank 0 (None elsewhere)."""
    from sparserl_mcore.sync.learner import mcore_name
    from sparserl_mcore.trainer.learner import unwrap_model

    core = unwrap_model(learner.model)
    return _to_hf(learner.layout, {mcore_name(n): p.detach().cpu() for n, p in core.named_parameters()}, rt)


def _to_hf(layout, tensors: dict[str, torch.Tensor], rt) -> dict[str, torch.Tensor] | None:
    pieces = []
    if rt.dp_rank == 0:
        for name, tensor in tensors.items():
            pieces.extend(layout.hf_pieces(layout.param(name, rt.tp_rank, rt.pp_rank), tensor))
    gathered = [None] * rt.world_size if rt.rank == 0 else None
    dist.gather_object([(n, r, c, t.clone()) for n, r, c, t in pieces], gathered, dst=0)
    if gathered is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, rows, cols, piece in (item for part in gathered for item in part):
        if name not in out:
            out[name] = torch.zeros(layout.hf_shapes[name], dtype=piece.dtype)
        target = out[name][rows] if cols is None else out[name][rows, cols]
        target.copy_(piece)
    return out
