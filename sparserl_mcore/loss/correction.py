"""Sparse-RL correction of the sparsity mismatch between the dense old policy and the sampler.

xi_t = pi_old(o_t) / pi_sparse(o_t) per response token (pi_sparse decoded over a compressed KV
cache, same weights as pi_old). Stages, each switched on by the mode:
  veto      -- a sequence with ANY valid token at xi < veto_threshold is dropped whole;
  reject    -- tokens with xi outside [reject_low, reject_high] leave the mask;
  reweight  -- w = min(xi, truncate_max), divided by the mean of w over the ORIGINALLY valid
               tokens of the whole (global) batch when `normalize` is on.
log xi is clamped to +-log_ratio_clamp before exp.

Multi-turn episodes: `turn_pieces` -> `reduce_metrics` -> `turn_metrics` report the mismatch KL,
the veto triggers and the band rejections per turn index (turn k's sampled tokens), since every turn
compresses a longer history.

Distributed use: the batch mean of w and the metric denominators are global. Compute
`CorrectionTotals.local(...)` on each rank's slice, `.all_reduce(dp_group)`, then pass the result
as `totals=`; metric pieces then sum (or max, see totals.MAX_METRICS) to the global values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from sparserl_mcore.loss.totals import all_reduce_fields

# mode -> (veto, reject, reweight). Exhaustive.
CORRECTION_MODES: dict[str, tuple[bool, bool, bool]] = {
    "off": (False, False, False),  # plain GRPO on sparse rollouts: weights 1, mask unchanged
    "tis": (False, False, True),  # truncated importance weights only
    "sparse_rl": (True, True, True),  # Sparse-RL: veto + token rejection + truncated weights
}


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """Thresholds of the correction; defaults are the Sparse-RL paper's released code."""

    mode: str = "sparse_rl"
    veto_threshold: float = 1e-4
    reject_low: float = 0.5
    reject_high: float = 1.5
    truncate_max: float = 1.5
    normalize: bool = True
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"mode={self.mode!r} is unknown; choose from {sorted(CORRECTION_MODES)}")
        if self.veto_threshold < 0:
            raise ValueError(f"veto_threshold={self.veto_threshold} must be >= 0 (0 disables the veto)")
        if not 0 <= self.reject_low < self.reject_high:
            raise ValueError(
                f"reject_low={self.reject_low}, reject_high={self.reject_high}: need 0 <= low < high"
            )
        if self.truncate_max <= 0:
            raise ValueError(f"truncate_max={self.truncate_max} must be > 0")
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")

    @property
    def stages(self) -> tuple[bool, bool, bool]:
        return CORRECTION_MODES[self.mode]


@dataclass(frozen=True)
class _Local:
    """Per-token quantities that need no batch statistics."""

    valid: Tensor  # [b, s] bool, the original mask
    log_xi: Tensor  # [b, s] clamped, 0 outside `valid`
    vetoed: Tensor  # [b] bool
    rejected: Tensor  # [b, s] bool, band rejection among valid tokens of kept sequences
    kept: Tensor  # [b, s] bool, the final mask
    raw_weights: Tensor  # [b, s] truncated xi (1 when not reweighting), 0 outside `valid`


def _local(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, cfg: CorrectionConfig) -> _Local:
    if logp_old.shape != logp_sparse.shape or logp_old.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            "logp_old, logp_sparse and mask must share one [batch, seq] shape, got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sparse.shape)}, {tuple(mask.shape)}"
        )
    veto, reject, reweight = cfg.stages
    valid = mask.bool()
    diff = (logp_old.float() - logp_sparse.float()).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    log_xi = torch.where(valid, diff, torch.zeros_like(diff))
    xi = log_xi.exp()
    no = torch.zeros_like(valid)
    vetoed = (valid & (xi < cfg.veto_threshold)).any(dim=1) if veto else no.any(dim=1)
    alive = valid & ~vetoed[:, None]
    rejected = alive & ((xi < cfg.reject_low) | (xi > cfg.reject_high)) if reject else no
    raw = xi.clamp(max=cfg.truncate_max) if reweight else torch.ones_like(xi)
    return _Local(
        valid=valid,
        log_xi=log_xi,
        vetoed=vetoed,
        rejected=rejected,
        kept=alive & ~rejected,
        raw_weights=torch.where(valid, raw, torch.zeros_like(raw)),
    )


@dataclass(frozen=True)
class CorrectionTotals:
    """Global denominators of the correction (sum over micro-batches and DP ranks).

    sequences: all sequences; valid_tokens: tokens of the original mask; kept_tokens: tokens of the
    final mask; weight_sum: sum of the truncated weights over the originally valid tokens.
    """

    sequences: Tensor
    valid_tokens: Tensor
    kept_tokens: Tensor
    weight_sum: Tensor

    @classmethod
    def local(
        cls, logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, cfg: CorrectionConfig | None = None
    ) -> CorrectionTotals:
        loc = _local(logp_old, logp_sparse, mask, cfg or CorrectionConfig())
        return cls._of(loc)

    @classmethod
    def _of(cls, loc: _Local) -> CorrectionTotals:
        f64 = torch.float64
        return cls(
            sequences=torch.tensor(float(loc.valid.shape[0]), dtype=f64, device=loc.valid.device),
            valid_tokens=loc.valid.sum(dtype=f64),
            kept_tokens=loc.kept.sum(dtype=f64),
            weight_sum=loc.raw_weights.sum(dtype=f64),
        )

    def all_reduce(self, group: dist.ProcessGroup | None) -> CorrectionTotals:
        return all_reduce_fields(self, group)


def sparse_rl_correction(
    logp_old: Tensor,
    logp_sparse: Tensor,
    mask: Tensor,
    cfg: CorrectionConfig | None = None,
    *,
    totals: CorrectionTotals | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights and the corrected loss mask for one [batch, seq] slice.

    Args:
        logp_old: dense pi_old log-probs of the response tokens (recomputed by the learner).
        logp_sparse: the sampler's log-probs returned with the rollout.
        mask: 1 on response tokens.
        cfg: thresholds and mode; None means `CorrectionConfig()` (Sparse-RL defaults).
        totals: global denominators; None computes them from this slice alone.

    Returns:
        weights [b, s] float32 (0 outside the final mask), final mask [b, s] float32, and metrics
        (0-d tensors; each is this slice's share of the global value, see module docstring):
        vetoed_sequences, vetoed_frac, rejected_token_frac (band rejections / valid tokens),
        kept_token_frac, abs_logp_diff_mean/max, mismatch_kl (k3 estimate of KL(pi_sparse||pi_old)
        from the sampled tokens), weight_mean/max over the final mask.
    """
    cfg = cfg or CorrectionConfig()
    loc = _local(logp_old, logp_sparse, mask, cfg)
    totals = totals or CorrectionTotals._of(loc)
    normalizer = torch.ones((), dtype=torch.float64, device=mask.device)
    if cfg.stages[2] and cfg.normalize:  # mean truncated weight; 1 when the batch has no valid token
        mean = totals.weight_sum / totals.valid_tokens.clamp(min=1)
        normalizer = torch.where(totals.weight_sum > 0, mean, normalizer)
    kept = loc.kept.float()
    weights = (loc.raw_weights / normalizer).float() * kept
    return weights, kept, _metrics(loc, weights, logp_old, logp_sparse, totals)


def _metrics(
    loc: _Local, weights: Tensor, logp_old: Tensor, logp_sparse: Tensor, totals: CorrectionTotals
) -> dict[str, Tensor]:
    def share(numerator: Tensor, denominator: Tensor) -> Tensor:
        return numerator.to(torch.float64) / denominator.clamp(min=1)

    zero = torch.zeros((), dtype=torch.float64, device=weights.device)
    abs_diff = torch.where(loc.valid, (logp_old.float() - logp_sparse.float()).abs(), 0.0)
    k3 = loc.log_xi.exp() - 1 - loc.log_xi  # per token >= 0; 0 outside valid (log_xi = 0 there)
    return {
        "correction/vetoed_sequences": loc.vetoed.sum(dtype=torch.float64),
        "correction/vetoed_frac": share(loc.vetoed.sum(), totals.sequences),
        "correction/rejected_token_frac": share(loc.rejected.sum(), totals.valid_tokens),
        "correction/kept_token_frac": share(loc.kept.sum(), totals.valid_tokens),
        "correction/abs_logp_diff_mean": share(abs_diff.sum(dtype=torch.float64), totals.valid_tokens),
        "correction/abs_logp_diff_max": abs_diff.max().to(torch.float64) if abs_diff.numel() else zero,
        "correction/mismatch_kl": share(k3.sum(dtype=torch.float64), totals.valid_tokens),
        "correction/weight_mean": share(weights.sum(dtype=torch.float64), totals.kept_tokens),
        "correction/weight_max": weights.max().to(torch.float64) if weights.numel() else zero,
    }


def turn_pieces(
    logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, turn: Tensor, turns: int, cfg: CorrectionConfig
) -> dict[str, Tensor]:
    """Per turn index k < `turns` (turn: [b, s] the turn that sampled each token, -1 elsewhere):
    sums over the tokens of `mask` that `totals.reduce_metrics` adds over micro-batches and DP
    ranks; `turn_metrics` finishes them. Every k is present, so all ranks report the same names."""
    if turn.shape != mask.shape:
        raise ValueError(f"turn has shape {tuple(turn.shape)}, mask {tuple(mask.shape)}")
    loc = _local(logp_old, logp_sparse, mask, cfg)
    xi = loc.log_xi.exp()
    triggers = loc.valid & (xi < cfg.veto_threshold) if cfg.stages[0] else torch.zeros_like(loc.valid)
    k3 = xi - 1 - loc.log_xi
    f64 = torch.float64
    pieces = {}
    for k in range(turns):
        at = loc.valid & (turn == k)
        pieces[f"turn/tokens{k}"] = at.sum(dtype=f64)
        pieces[f"turn/k3_sum{k}"] = torch.where(at, k3, 0.0).sum(dtype=f64)
        pieces[f"turn/segments{k}"] = at.any(dim=1).sum(dtype=f64)
        pieces[f"turn/veto_segments{k}"] = (at & triggers).any(dim=1).sum(dtype=f64)
        pieces[f"turn/rejected{k}"] = (at & loc.rejected).sum(dtype=f64)
    return pieces


def turn_metrics(reduced: dict[str, float], turns: int) -> dict[str, float]:
    """Reduced `turn_pieces` (other metrics pass through) -> per turn k that has tokens:
    `correction/mismatch_kl_turn<k>` (k3 mean over turn k's tokens), `correction/veto_frac_turn<k>`
    (the share of turn-k segments holding a token under the veto threshold: the turns that veto
    their episode) and `correction/rejected_token_frac_turn<k>` (band rejections / turn k's tokens)."""
    out = {k: v for k, v in reduced.items() if not k.startswith("turn/")}
    for k in range(turns):
        tokens, segments = reduced[f"turn/tokens{k}"], reduced[f"turn/segments{k}"]
        if not tokens:
            continue
        out[f"correction/mismatch_kl_turn{k}"] = reduced[f"turn/k3_sum{k}"] / tokens
        out[f"correction/veto_frac_turn{k}"] = reduced[f"turn/veto_segments{k}"] / segments
        out[f"correction/rejected_token_frac_turn{k}"] = reduced[f"turn/rejected{k}"] / tokens
    return out
