"""Decoupled (three-policy) PPO loss with k3 KL to a reference and an entropy bonus.

Per response token t of sequence i (m = the corrected loss mask, w = Sparse-RL weights):
  r_t  = exp(logp_theta - logp_old)
  pg_t = w_t * max(-r_t * A, -clip(r_t, 1 - clip_eps, 1 + clip_eps_high) * A)
  kl_t = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1          (k3, >= 0)
  loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)
Aggregations (registry AGGREGATIONS):
  seq_mean   -- per-sequence mean over m, then mean over ALL sequences of the global batch
                (a vetoed sequence adds 0 but counts in the denominator), Sparse-RL's choice;
  token_mean -- sum over m divided by the global number of tokens in m.
The global denominators come in `totals` (see totals.LossTotals); by default they are this
batch's own, so the result is the single-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl_mcore.loss.totals import LossTotals


def _seq_mean(x: Tensor, mask: Tensor, totals: LossTotals) -> Tensor:
    per_seq = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / totals.sequences.clamp(min=1).to(x.dtype)


def _token_mean(x: Tensor, mask: Tensor, totals: LossTotals) -> Tensor:
    return (x * mask).sum() / totals.tokens.clamp(min=1).to(x.dtype)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, LossTotals], Tensor]] = {
    "seq_mean": _seq_mean,
    "token_mean": _token_mean,
}


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """PPO clip range (asymmetric allowed), KL and entropy coefficients, aggregation.

    Defaults follow Sparse-RL: eps 0.2 both sides, k3 KL coef 1e-4 (applied when reference
    log-probs are passed), no entropy bonus, seq_mean aggregation.
    """

    clip_eps: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 1e-4
    entropy_coef: float = 0.0
    aggregation: str = "seq_mean"

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps={self.clip_eps} must be in (0, 1)")
        if self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef} must be >= 0 (0 disables)"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={self.aggregation!r} is unknown; choose from {sorted(AGGREGATIONS)}"
            )


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None = None,
    cfg: PolicyLossConfig | None = None,
    logp_ref: Tensor | None = None,
    *,
    entropy: Tensor | None = None,
    totals: LossTotals | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one [batch, seq] slice and its metrics.

    Args:
        logp: learner log-probs (differentiable); logp_old: dense pi_old log-probs.
        advantages: [batch, seq] or [batch] (broadcast over tokens).
        mask: the (corrected) loss mask, 1 on tokens that train.
        weights: per-token importance weights (Sparse-RL correction); None means 1.
        logp_ref: reference log-probs; the k3 KL term is added only when given.
        entropy: per-token entropy of the learner (differentiable for the bonus); optional.
        totals: global denominators; None uses this slice's own.

    Returns:
        (loss 0-d, metrics) where every metric is this slice's share of the global value:
        policy/loss, policy/pg_loss, policy/clip_frac (token fraction where the clipped branch
        is taken), policy/kl and policy/entropy (aggregated like the loss, when given).
    """
    cfg = cfg or PolicyLossConfig()
    _check_shapes(logp, logp_old, mask, advantages, weights, logp_ref, entropy)
    totals = totals or LossTotals.local(mask)
    aggregate = AGGREGATIONS[cfg.aggregation]
    valid = mask.bool()
    m = mask.to(torch.float32)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    # where() instead of *mask: masked positions may hold garbage and exp() must not overflow there.
    log_ratio = torch.where(valid, logp.float() - logp_old.float(), 0.0)
    ratio = log_ratio.exp()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high) * adv
    pg = torch.maximum(unclipped, clipped)
    if weights is not None:
        pg = pg * weights.float()
    pg_loss = aggregate(pg, m, totals)
    loss = pg_loss
    metrics = {
        "policy/pg_loss": pg_loss.detach(),
        "policy/clip_frac": ((clipped > unclipped) & valid).sum(dtype=torch.float64)
        / totals.tokens.clamp(min=1),
    }
    if logp_ref is not None:
        ref_diff = torch.where(valid, logp_ref.float() - logp.float(), 0.0)
        kl = aggregate(ref_diff.exp() - ref_diff - 1, m, totals)
        loss = loss + cfg.kl_coef * kl
        metrics["policy/kl"] = kl.detach()
    if entropy is not None:
        ent = aggregate(torch.where(valid, entropy.float(), 0.0), m, totals)
        loss = loss - cfg.entropy_coef * ent
        metrics["policy/entropy"] = ent.detach()
    metrics["policy/loss"] = loss.detach()
    return loss, metrics


def _check_shapes(logp, logp_old, mask, advantages, weights, logp_ref, entropy) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, seq], got shape {tuple(mask.shape)}")
    named = {"logp": logp, "logp_old": logp_old, "weights": weights, "logp_ref": logp_ref, "entropy": entropy}
    for name, t in named.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected mask's {tuple(mask.shape)}")
    if advantages.shape not in (mask.shape, mask.shape[:1]):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected {tuple(mask.shape)} or "
            f"({mask.shape[0]},)"
        )
