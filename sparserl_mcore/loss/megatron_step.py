"""The RL update inside megatron-core: log-prob recompute and K reuse epochs gated by DGG.

Public API (the trainer calls these; shapes use the legend B = this DP rank's sequences,
T = tokens per sequence; per-token tensors are indexed by the position of the token they score,
i.e. the log-prob of tokens_BT[:, t] comes from the logits at t - 1, so mask_BT[:, 0] must be 0):

    compute_logprobs(model, tokens_BT, *, micro_batch_size, temperature, vocab_size, runtime,
                     fused=True, mask_BT=None)
        -> [B, T] float32 on the last pipeline stage, None elsewhere (forward only; pi_old, pi_ref).
    train_on_batch(model, optimizer, batch, *, cfg, gate, runtime, scheduler=None) -> UpdateResult
        up to K = cfg.epochs passes over the batch, each of `minibatches_per_epoch` optimizer
        updates; DGG decides between `prepare_grads()` and `step_with_ready_grads()`.

Every rank of the job calls both with its DP slice (identical on the TP/PP ranks of one
model-parallel group). All normalisers are global: the Sparse-RL weight mean and the loss
denominators are all-reduced over DP before the loss is evaluated, and each micro-batch's loss
is its share of the global loss; megatron's averaging over micro-batches and DP ranks is undone
by one scale factor so the accumulated gradient is exactly the gradient of the global loss.
Metrics are reduced over micro-batches and DP on the last stage and broadcast over PP, so every
rank returns the same numbers.

Log-probs come from one of two paths, the same numbers to fp32 rounding (tests/test_loss_fused_logprob.py):
`fused` (UpdateConfig.fused_logprob, the default) runs the decoder to its final hidden states and
projects only the rows whose next token is a response token through the head fused with the
log-prob (loss/fused_logprob.py: no [tokens, vocab] logits); the other runs megatron's output layer
over every position and `vocab_parallel_logprobs` on its logits (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.utils import get_model_config
from torch import Tensor

from sparserl_mcore.loss import staleness
from sparserl_mcore.loss.correction import (
    CorrectionConfig,
    CorrectionTotals,
    sparse_rl_correction,
    turn_metrics,
    turn_pieces,
)
from sparserl_mcore.loss.dgg import DynamicGradientGate, GateDecision
from sparserl_mcore.loss.fused_head import Head, fused_token_logprobs, response_rows
from sparserl_mcore.loss.lm_head_grad import lm_head_grad_energy
from sparserl_mcore.loss.policy import PolicyLossConfig, policy_loss
from sparserl_mcore.loss.totals import LossTotals, reduce_metrics
from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs
from sparserl_mcore.loss.weight_change import WeightChange
from sparserl_mcore.parallel import optim_step
from sparserl_mcore.parallel.forward import (
    forward_only,
    hidden_forward,
    model_forward,
    padding_mask,
    run_schedule,
)
from sparserl_mcore.parallel.runtime import Runtime


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How a rollout batch is consumed: K = `epochs` passes (batch reuse; 1 = single-use GRPO) of
    `minibatches_per_epoch` optimizer updates each. DGG (DGGConfig) may only end the reuse early."""

    micro_batch_size: int = 1
    minibatches_per_epoch: int = 1
    epochs: int = 1
    temperature: float = 1.0
    vocab_size: int | None = None  # the HF vocabulary; Megatron's padding ids above it are excluded
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # asynchronous RL: tokens more than this many versions older than the learner leave the loss
    # (counted); batches then carry lag_BT. None: synchronous, no lag.
    max_staleness: int | None = None
    # the head fused with the log-prob, response rows only (module docstring); False: the output
    # layer's full logits into vocab_parallel_logprobs
    fused_logprob: bool = True
    # multi-turn episodes: batches carry turn_BT and the correction is also reported per turn
    # index < max_turns (correction.turn_metrics). None: single-turn.
    max_turns: int | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "minibatches_per_epoch", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness} must be >= 0 (or None: synchronous)")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (the sampler's temperature)")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns} must be >= 1 (or None: single-turn)")


@dataclass(frozen=True)
class UpdateBatch:
    """This DP rank's slice of a rollout batch (see the module docstring for the convention)."""

    tokens_BT: Tensor  # int64
    mask_BT: Tensor  # 1 on response tokens
    advantages_B: Tensor  # GRPO advantage per sequence ([B, T] also accepted)
    logp_sparse_BT: Tensor  # the sampler's log-probs, 0 outside the mask
    logp_ref_BT: Tensor | None = None  # reference log-probs (last stage) for the KL term
    lag_BT: Tensor | None = None  # policy versions between each token's sampler and the learner (async)
    # real tokens per row (the rest is right padding): MoE routers leave padding out of their aux
    # loss, z-loss and counts. None: every position is real.
    lengths_B: Tensor | None = None
    # rollout routing replay: the engine's expert ids [B, T, layers, k] (-1 where it routed none),
    # replayed by the MoE routers in the pi_old recompute and the policy forward. None: route freely.
    routed_BTLK: Tensor | None = None
    # multi-turn episodes: the turn that sampled tokens_BT[:, t], -1 elsewhere (per-turn metrics)
    turn_BT: Tensor | None = None

    def check(self, cfg: UpdateConfig) -> None:
        b, t = self.tokens_BT.shape
        for name in ("mask_BT", "logp_sparse_BT", "lag_BT", "turn_BT"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, tokens_BT {(b, t)}")
        if self.lengths_B is not None and tuple(self.lengths_B.shape) != (b,):
            raise ValueError(f"lengths_B has shape {tuple(self.lengths_B.shape)}, expected {(b,)}")
        if self.routed_BTLK is not None and tuple(self.routed_BTLK.shape[:2]) != (b, t):
            raise ValueError(f"routed_BTLK has shape {tuple(self.routed_BTLK.shape)}, tokens_BT {(b, t)}")
        if (self.lag_BT is None) != (cfg.max_staleness is None):
            raise ValueError(
                "lag_BT and UpdateConfig.max_staleness go together (asynchronous RL) or are both None"
            )
        if (self.turn_BT is None) != (cfg.max_turns is None):
            raise ValueError("turn_BT and UpdateConfig.max_turns go together (multi-turn) or are both None")
        if bool(self.mask_BT[:, 0].any()):
            raise ValueError("mask_BT[:, 0] is set: the first token has no logits before it to score it")
        step = cfg.minibatches_per_epoch * cfg.micro_batch_size
        if b % step:
            raise ValueError(
                f"{b} sequences on this DP rank do not split into minibatches_per_epoch="
                f"{cfg.minibatches_per_epoch} x micro_batch_size={cfg.micro_batch_size}"
            )


@dataclass(frozen=True)
class UpdateResult:
    """What one rollout batch did to the model; identical on every rank.

    metrics: correction/* (once per batch), policy/* and dwd/* averaged over the applied updates,
    train/updates, train/epochs, dgg/gated, dgg/z_max (once the gate's window is full).
    updates: per optimizer update (applied or gated): policy/*, dgg/*, train/grad_norm, train/lr,
    dwd/* (applied updates, with `dgg.weight_change`: loss/weight_change.py).
    """

    metrics: dict[str, float]
    updates: list[dict[str, float]]
    gated: bool
    decisions: list[GateDecision]


def _token_logprobs(
    logits_BTV: Tensor, tokens_BT: Tensor, *, runtime: Runtime, temperature: float, vocab_size: int | None
) -> tuple[Tensor, Tensor]:
    """[B, T] log-probs and entropies from TP-local logits; position 0 (no context) is 0."""
    v_local = logits_BTV.shape[-1]
    logp, ent = vocab_parallel_logprobs(
        logits_BTV[:, :-1],
        tokens_BT[:, 1:],
        group=runtime.groups.tp,
        vocab_start=runtime.tp_rank * v_local,
        vocab_size=vocab_size,
        temperature=temperature,
    )
    pad = (1, 0)
    return torch.nn.functional.pad(logp, pad), torch.nn.functional.pad(ent, pad)


def compute_logprobs(
    model: torch.nn.Module,
    tokens_BT: Tensor,
    *,
    micro_batch_size: int,
    temperature: float,
    vocab_size: int | None,
    runtime: Runtime,
    fused: bool = True,
    mask_BT: Tensor | None = None,
    routed_BTLK: Tensor | None = None,
) -> Tensor | None:
    """Per-token log-probs of `tokens_BT` under `model` (forward only, no vocab gather).

    `fused`: through the fused head (module docstring); then with `mask_BT` only the tokens in the
    mask are scored (0 elsewhere), without it every position 1..T-1. `routed_BTLK`: expert ids the
    MoE routers replay (`UpdateBatch.routed_BTLK`)."""
    if micro_batch_size < 1 or tokens_BT.shape[0] % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must divide the batch size {tokens_BT.shape[0]}"
        )
    tokens_BT = tokens_BT.to(runtime.device)
    micro_batches = list(tokens_BT.split(micro_batch_size))
    routed = None if routed_BTLK is None else list(routed_BTLK.split(micro_batch_size))
    if not fused:

        def post(logits_BTV: Tensor, tokens: Tensor) -> Tensor:
            return _token_logprobs(
                logits_BTV, tokens, runtime=runtime, temperature=temperature, vocab_size=vocab_size
            )[0]

        outputs = forward_only(
            model, micro_batches, post_fn=post, groups=runtime.groups, routed_experts=routed
        )
        return torch.cat(outputs) if runtime.is_last_stage else None

    head = Head.of(model) if runtime.is_last_stage else None
    masks = mask_BT.split(micro_batch_size) if mask_BT is not None and runtime.is_last_stage else None
    rows = iter([response_rows(m, runtime.device) for m in masks] if masks is not None else [])

    def post_hidden(hidden_SBH: Tensor, tokens: Tensor) -> Tensor:
        assert head is not None, "megatron calls post_fn on the last pipeline stage"
        return fused_token_logprobs(
            hidden_SBH,
            tokens,
            next(rows) if masks is not None else None,
            head=head,
            runtime=runtime,
            temperature=temperature,
            vocab_size=vocab_size,
        )[0]

    outputs = forward_only(
        model,
        micro_batches,
        post_fn=post_hidden,
        groups=runtime.groups,
        forward=hidden_forward,
        routed_experts=routed,
    )
    return torch.cat(outputs) if runtime.is_last_stage else None


def _loss_func(
    mb: dict,
    output: Tensor,
    *,
    totals: LossTotals | None,
    scale: float,
    runtime: Runtime,
    cfg: UpdateConfig,
    head: Head | None,
):
    """megatron's loss_func contract: (loss, metrics); `scale` undoes its micro-batch/DP averaging.
    With `head` (fused path) the output is the final hidden states, else the TP-local logits."""
    assert totals is not None, "megatron calls loss_func on the last pipeline stage, which has totals"
    if head is not None:
        logp, ent = fused_token_logprobs(
            output,
            mb["tokens"],
            mb["rows"],
            head=head,
            runtime=runtime,
            temperature=cfg.temperature,
            vocab_size=cfg.vocab_size,
        )
    else:
        logp, ent = _token_logprobs(
            output, mb["tokens"], runtime=runtime, temperature=cfg.temperature, vocab_size=cfg.vocab_size
        )
    entropy = ent if cfg.policy.entropy_coef > 0 else ent.detach()
    loss, metrics = policy_loss(
        logp,
        mb["logp_old"],
        mb["advantages"],
        mb["mask"],
        mb["weights"],
        cfg.policy,
        mb["logp_ref"],
        entropy=entropy,
        totals=totals,
    )
    return loss * scale, metrics


def _forward_step(loss_fn, fused: bool, data_iterator, model):
    mb = next(data_iterator)
    forward = hidden_forward if fused else model_forward
    output, cut = forward(model, mb["tokens"], padding_BT=mb["padding"], routed_BTLK=mb.get("routed"))
    return output, lambda out: loss_fn(mb, cut(out))


def _micro_batches(tensors: dict[str, Tensor | None], rows: slice, size: int) -> list[dict]:
    """Split rows of every (optional) tensor into micro-batches of `size` sequences."""
    out = []
    for start in range(rows.start, rows.stop, size):
        sl = slice(start, start + size)
        out.append({k: None if v is None else v[sl] for k, v in tensors.items()})
    return out


def _forward_backward(model, micro_batches: list[dict], loss_fn, runtime: Runtime, fused: bool) -> list[dict]:
    b, t = micro_batches[0]["tokens"].shape
    return run_schedule(
        model,
        micro_batches,
        partial(_forward_step, loss_fn, fused),
        groups=runtime.groups,
        micro_batch_size=b,
        seq_length=t,
        forward_only=False,
    )


def _wire_model_config(model, optimizer) -> None:
    """What megatron's own training loop sets on the model config before forward_backward."""
    config = get_model_config(model)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads


def _agree(flag: bool, device: torch.device, group: dist.ProcessGroup) -> bool:
    """OR of a boolean over `group` (the learner's ranks): collective control flow must not diverge."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _broadcast_from_last_stage(obj, runtime: Runtime):
    if runtime.pp_size == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(runtime.groups.pp, runtime.pp_size - 1)
    dist.broadcast_object_list(box, src=src, group=runtime.groups.pp)
    return box[0]


def _correct(batch: UpdateBatch, logp_old: Tensor, cfg: UpdateConfig, runtime: Runtime):
    """Sparse-RL weights and mask with the weight mean taken over the global (DP) batch. With
    asynchronous rollouts (lag_BT), tokens older than max_staleness leave the mask first and the
    mismatch is reported per lag (loss/staleness.py); pi_old is then the proximal policy and the
    sampler's log-probs the behavior policy's, so the one correction covers both mismatches."""
    mask = batch.mask_BT.to(runtime.device)
    logp_sparse = batch.logp_sparse_BT.to(runtime.device)
    lag_pieces: dict[str, Tensor] = {}
    if batch.lag_BT is not None and cfg.max_staleness is not None:  # both or neither (check)
        lag = batch.lag_BT.to(runtime.device)
        lag_pieces = staleness.lag_pieces(logp_old, logp_sparse, mask, lag, cfg.max_staleness)
        mask = staleness.drop_stale(mask, lag, cfg.max_staleness)
    totals = CorrectionTotals.local(logp_old, logp_sparse, mask, cfg.correction).all_reduce(runtime.groups.dp)
    per_turn: dict[str, Tensor] = {}
    if batch.turn_BT is not None and cfg.max_turns is not None:  # both or neither (check)
        turn = batch.turn_BT.to(runtime.device)
        per_turn = turn_pieces(logp_old, logp_sparse, mask, turn, cfg.max_turns, cfg.correction)
    weights, mask, metrics = sparse_rl_correction(logp_old, logp_sparse, mask, cfg.correction, totals=totals)
    reduced = reduce_metrics([{**metrics, **lag_pieces, **per_turn}], runtime.groups.dp)
    if lag_pieces and cfg.max_staleness is not None:
        reduced = staleness.lag_metrics(reduced, cfg.max_staleness)
    if per_turn and cfg.max_turns is not None:
        reduced = turn_metrics(reduced, cfg.max_turns)
    return weights, mask, reduced


def _one_update(
    model, optimizer, data: dict, rows: slice, reuse_index: int, *, cfg, gate, runtime, scheduler, dwd
):
    """forward_backward over one minibatch, then DGG between prepare_grads and the step; `dwd`
    (a WeightChange or None) measures what an applied step did to lm_head and the middle layers."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    micro_batches = _micro_batches(data, rows, cfg.micro_batch_size)
    totals, head = None, None
    if runtime.is_last_stage:
        totals = LossTotals.local(data["mask"][rows]).all_reduce(runtime.groups.dp)
        if cfg.fused_logprob:
            head = Head.of(model)
            for mb in micro_batches:  # the original response mask: the corrected one is a subset
                mb["rows"] = response_rows(mb["response"], runtime.device)
    # megatron divides each micro-batch loss by their number and the gradient by the DP size.
    scale = float(len(micro_batches) * runtime.dp_size)
    loss_fn = partial(_loss_func, totals=totals, scale=scale, runtime=runtime, cfg=cfg, head=head)
    pieces = _forward_backward(model, micro_batches, loss_fn, runtime, cfg.fused_logprob)
    check = optim_step.prepare_and_check(optimizer)  # the verdict and the grad norm: one host sync
    found_inf = check.found_inf
    energy = lm_head_grad_energy(
        model,
        optimizer,
        is_last_stage=runtime.is_last_stage,
        dp_group=runtime.groups.dp,
        group=runtime.learner_group,
    )
    decision = gate.decide(energy, reuse_index)
    decision = replace(decision, gate=_agree(decision.gate, runtime.device, runtime.learner_group))
    record = {**decision.as_metrics(), "train/found_inf": float(found_inf)}
    if not decision.gate and not found_inf:
        record["train/grad_norm"] = check.grad_norm
        optim_step.clip_grads(optimizer, check.grad_norm)
        if dwd is not None:
            dwd.before_step()
        optimizer.step_with_ready_grads()
        if dwd is not None:
            record.update(dwd.after_step())
        if scheduler is not None:
            scheduler.step(1)
        gate.update(decision)
    record["train/lr"] = float(optimizer.param_groups[0]["lr"])
    if runtime.is_last_stage:
        record.update(reduce_metrics(pieces, runtime.groups.dp))
    return record, decision


def train_on_batch(
    model,
    optimizer,
    batch: UpdateBatch,
    *,
    cfg: UpdateConfig,
    gate: DynamicGradientGate,
    runtime: Runtime,
    scheduler=None,
) -> UpdateResult:
    """Up to K = cfg.epochs passes over `batch`; a gated update is dropped and ends the reuse.

    Args:
        model: this rank's GPTModel stage wrapped in megatron DistributedDataParallel.
        optimizer: from `get_megatron_optimizer` over [model] (distributed or not).
        batch: this DP rank's slice; pi_old log-probs are recomputed here from the current weights.
        gate: DGG state carried across rollout batches (its window spans batches).
        scheduler: megatron OptimizerParamScheduler; ticked once per APPLIED update only.
    """
    batch.check(cfg)
    if runtime.cp_size != 1:
        raise ValueError(f"context_parallel_size={runtime.cp_size}: the RL loss supports CP = 1 only")
    _wire_model_config(model, optimizer)
    logp_old = compute_logprobs(
        model,
        batch.tokens_BT,
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature,
        vocab_size=cfg.vocab_size,
        runtime=runtime,
        fused=cfg.fused_logprob,
        mask_BT=batch.mask_BT,
        routed_BTLK=batch.routed_BTLK,
    )
    data = _stage_data(batch, logp_old, runtime)
    correction_metrics = {}
    if runtime.is_last_stage:
        assert logp_old is not None, "the last stage computes pi_old"
        data["weights"], data["mask"], correction_metrics = _correct(batch, logp_old, cfg, runtime)
    per_minibatch = batch.tokens_BT.shape[0] // cfg.minibatches_per_epoch
    dwd = None
    if gate.cfg.weight_change:
        dwd = WeightChange(
            model,
            optimizer,
            is_last_stage=runtime.is_last_stage,
            tp_group=runtime.groups.tp,
            dp_group=runtime.groups.dp,
            group=runtime.learner_group,
        )
    updates, decisions = [], []
    for k in range(1, cfg.epochs + 1):
        for j in range(cfg.minibatches_per_epoch):
            rows = slice(j * per_minibatch, (j + 1) * per_minibatch)
            record, decision = _one_update(
                model,
                optimizer,
                data,
                rows,
                k,
                cfg=cfg,
                gate=gate,
                runtime=runtime,
                scheduler=scheduler,
                dwd=dwd,
            )
            updates.append(record)
            decisions.append(decision)
            if decision.gate:
                break
        if decisions[-1].gate:
            break
    correction_metrics, updates = _broadcast_from_last_stage((correction_metrics, updates), runtime)
    return UpdateResult(
        metrics=_summary(correction_metrics, updates, decisions),
        updates=updates,
        gated=decisions[-1].gate,
        decisions=decisions,
    )


def _stage_data(batch: UpdateBatch, logp_old: Tensor | None, runtime: Runtime) -> dict[str, Tensor | None]:
    """Per-row tensors of this stage: the first stage embeds tokens, the last computes the loss."""
    last = runtime.is_last_stage
    to = runtime.device
    return {
        "tokens": batch.tokens_BT.to(to),
        "advantages": batch.advantages_B.to(to) if last else None,
        "logp_old": logp_old,
        "logp_ref": batch.logp_ref_BT.to(to) if last and batch.logp_ref_BT is not None else None,
        "mask": None,
        "weights": None,
        "padding": None if batch.lengths_B is None else padding_mask(batch.tokens_BT, batch.lengths_B).to(to),
        "response": batch.mask_BT.cpu() if last else None,  # on the host: response_rows reads it
        "routed": batch.routed_BTLK,
    }


def _summary(
    correction: dict[str, float], updates: list[dict], decisions: list[GateDecision]
) -> dict[str, float]:
    applied = [u for u, d in zip(updates, decisions, strict=True) if not d.gate and not u["train/found_inf"]]
    pool = applied or updates
    means = {k: sum(u[k] for u in pool) / len(pool) for k in pool[0] if k.startswith(("policy/", "dwd/"))}
    zs = [d.z for d in decisions if d.z is not None]
    return {
        **correction,
        **means,
        **({"dgg/z_max": max(zs)} if zs else {}),
        "train/updates": float(len(applied)),
        "train/epochs": float(decisions[-1].reuse_index),
        "dgg/gated": float(decisions[-1].gate),
    }
