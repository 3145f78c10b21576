"""Version lag of asynchronous rollouts: too-stale tokens leave the loss; the mismatch is split by lag.

Asynchronous RL trains on tokens sampled by older weights than the learner's. The loss stays
decoupled PPO (AReaL's formulation, see docs/loss.md): pi_prox is pi_old recomputed from the
learner's current weights (the PPO ratio pi_theta / pi_prox, policy.py), and the behavior policy is
the sampler as it was, compressed KV AND the version that sampled the token, so its log-prob is
the engine's. The behavior weight pi_prox / pi_behavior is exactly Sparse-RL's xi (correction.py:
veto, rejection band, truncated and normalised weight): ONE correction covers compression and
staleness. This module adds what only versions can tell:

- `drop_stale`: tokens whose lag exceeds `max_staleness` (eta) leave the mask; they are counted
  (`staleness/masked_tokens`), never dropped silently;
- `lag_pieces` -> `reduce_metrics` -> `lag_metrics`: the tokens of each lag 0..eta (the staleness
  histogram), mean and max lag, and the k3 mismatch KL(pi_behavior || pi_prox) per lag. Lag-0
  tokens were sampled by the very weights pi_prox has, so their mismatch is compressed-vs-dense
  at equal version (`mismatch/compression_kl`); `mismatch/version_lag_kl` is how much larger the
  mismatch of the older tokens is (their KL minus the lag-0 one; reported when both exist).

Lag is counted in policy versions the learner published (trainer/staleness.py); 0 = sampled by
the weights being trained from.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # as CorrectionConfig.log_ratio_clamp's default: exp() stays finite
_F64 = torch.float64


def drop_stale(mask: Tensor, lag: Tensor, max_staleness: int) -> Tensor:
    """`mask` without the tokens older than `max_staleness` versions (same dtype)."""
    return torch.where(lag > max_staleness, torch.zeros_like(mask), mask)


def lag_pieces(
    logp_prox: Tensor, logp_behavior: Tensor, mask: Tensor, lag: Tensor, max_staleness: int
) -> dict[str, Tensor]:
    """Per-lag sums over the response tokens in `mask` (before `drop_stale`), as metric pieces that
    `totals.reduce_metrics` sums over micro-batches and DP ranks; `lag_metrics` finishes them."""
    if not (logp_prox.shape == logp_behavior.shape == mask.shape == lag.shape) or mask.dim() != 2:
        raise ValueError(
            "logp_prox, logp_behavior, mask and lag must share one [batch, seq] shape, got "
            f"{tuple(logp_prox.shape)}, {tuple(logp_behavior.shape)}, {tuple(mask.shape)}, {tuple(lag.shape)}"
        )
    valid = mask.bool()
    diff = (logp_prox.float() - logp_behavior.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_xi = torch.where(valid, diff, torch.zeros_like(diff))
    k3 = log_xi.exp() - 1 - log_xi  # >= 0 per token, 0 outside valid
    big = torch.iinfo(lag.dtype).max
    lowest = torch.where(valid, lag, torch.full_like(lag, big)).min(dim=1).values
    lag = torch.where(valid, lag, torch.zeros_like(lag))
    spans = valid.any(dim=1) & (lag.max(dim=1).values > lowest)  # an update landed inside it
    pieces = {
        "staleness/tokens": valid.sum(dtype=_F64),
        "staleness/mixed_sequences": spans.sum(dtype=_F64),
        "staleness/lag_sum": lag.sum(dtype=_F64),
        "staleness/lag_max": lag.max().to(_F64) if lag.numel() else torch.zeros((), dtype=_F64),
        "staleness/masked_tokens": (valid & (lag > max_staleness)).sum(dtype=_F64),
    }
    for k in range(max_staleness + 1):
        at = valid & (lag == k)
        pieces[f"staleness/tokens_lag{k}"] = at.sum(dtype=_F64)
        pieces[f"mismatch/k3_sum_lag{k}"] = torch.where(at, k3, 0.0).sum(dtype=_F64)
    return pieces


def lag_metrics(reduced: dict[str, float], max_staleness: int) -> dict[str, float]:
    """Reduced `lag_pieces` (plus any other metrics, passed through) -> the reported numbers: the
    histogram `staleness/tokens_lag<k>`, `staleness/masked_tokens`, `staleness/lag_mean|max`,
    `staleness/mixed_sequences` (sequences whose tokens came from more than one version), and the
    mismatch per lag `mismatch/kl_lag<k>`, `mismatch/compression_kl`, `mismatch/version_lag_kl` (only
    where the lag has tokens)."""
    out = {k: v for k, v in reduced.items() if not k.startswith("mismatch/k3_sum_lag")}
    tokens = out.pop("staleness/tokens")
    out["staleness/lag_mean"] = out.pop("staleness/lag_sum") / tokens if tokens else 0.0
    stale_k3 = stale_n = 0.0
    for k in range(max_staleness + 1):
        n, k3 = reduced[f"staleness/tokens_lag{k}"], reduced[f"mismatch/k3_sum_lag{k}"]
        if n:
            out[f"mismatch/kl_lag{k}"] = k3 / n
        if k:
            stale_k3, stale_n = stale_k3 + k3, stale_n + n
    if "mismatch/kl_lag0" in out:
        out["mismatch/compression_kl"] = out["mismatch/kl_lag0"]
        if stale_n:
            out["mismatch/version_lag_kl"] = stale_k3 / stale_n - out["mismatch/kl_lag0"]
    return out
