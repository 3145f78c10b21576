"""Hand-computed small examples for GRPO advantages, the Sparse-RL correction and the policy loss."""

import math

import pytest
import torch

from sparserl_mcore.loss import (
    CorrectionConfig,
    CorrectionTotals,
    LossTotals,
    PolicyLossConfig,
    broadcast_to_tokens,
    grpo_advantages,
    policy_loss,
    reduce_metrics,
    sparse_rl_correction,
)

# --- GRPO -------------------------------------------------------------------------------------


def test_grpo_advantages_by_hand():
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), 4)
    s = math.sqrt(1 / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    no_std = grpo_advantages(torch.tensor([3.0, 1.0]), 2, normalize_std=False)
    torch.testing.assert_close(no_std, torch.tensor([1.0, -1.0]))
    tok = broadcast_to_tokens(no_std, torch.tensor([[0, 1, 1], [1, 1, 0]]))
    torch.testing.assert_close(tok, torch.tensor([[0.0, 1, 1], [-1, -1, 0]]))


@pytest.mark.parametrize(
    "rewards, group, match",
    [
        (torch.zeros(6), 4, "multiple of group_size"),
        (torch.zeros(4), 1, "at least 2"),
        (torch.zeros(2, 2), 2, "1-D"),
    ],
)
def test_grpo_advantages_rejects_bad_input(rewards, group, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group)


# --- Sparse-RL correction -----------------------------------------------------------------------
# seq0: xi = [1, 0.4, 1.2] + pad   -> token 1 rejected (< 0.5)
# seq1: xi = [1, 1e-5, 1, 1]       -> vetoed (1e-5 < 1e-4)
# seq2: prompt, xi = [2.0, 1.4, 0.6] -> token 1 rejected (> 1.5) and its weight truncated to 1.5
XI = [[1.0, 0.4, 1.2, 1.0], [1.0, 1e-5, 1.0, 1.0], [1.0, 2.0, 1.4, 0.6]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]])


def _example():
    logp_sparse = -torch.arange(12, dtype=torch.float32).view(3, 4) / 7
    logp_old = logp_sparse + torch.tensor(XI).log()
    logp_old[0, 3] = 50.0  # garbage outside the mask must not matter
    return logp_old, logp_sparse


def test_sparse_rl_veto_reject_reweight_normalise_by_hand():
    logp_old, logp_sparse = _example()
    weights, mask, m = sparse_rl_correction(logp_old, logp_sparse, MASK)
    truncated = [1, 0.4, 1.2, 1, 1e-5, 1, 1, 1.5, 1.4, 0.6]  # all 10 originally valid tokens
    mean_w = sum(truncated) / 10
    expected_mask = torch.tensor([[1.0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]])
    torch.testing.assert_close(mask, expected_mask)
    expected_w = torch.tensor([[1.0, 0, 1.2, 0], [0, 0, 0, 0], [0, 0, 1.4, 0.6]]) / mean_w
    torch.testing.assert_close(weights, expected_w, rtol=1e-5, atol=1e-6)
    assert float(m["correction/vetoed_sequences"]) == 1
    assert float(m["correction/vetoed_frac"]) == pytest.approx(1 / 3)
    assert float(m["correction/rejected_token_frac"]) == pytest.approx(2 / 10)
    assert float(m["correction/kept_token_frac"]) == pytest.approx(4 / 10)
    assert float(m["correction/weight_mean"]) == pytest.approx((1 + 1.2 + 1.4 + 0.6) / mean_w / 4, rel=1e-5)
    assert float(m["correction/weight_max"]) == pytest.approx(1.4 / mean_w, rel=1e-5)
    valid_xi = [1, 0.4, 1.2, 1, 1e-5, 1, 1, 2.0, 1.4, 0.6]
    diffs = [abs(math.log(x)) for x in valid_xi]
    assert float(m["correction/abs_logp_diff_mean"]) == pytest.approx(sum(diffs) / 10, rel=1e-5)
    assert float(m["correction/abs_logp_diff_max"]) == pytest.approx(math.log(1e5), rel=1e-5)
    k3 = sum(x - 1 - math.log(x) for x in valid_xi) / 10
    assert float(m["correction/mismatch_kl"]) == pytest.approx(k3, rel=1e-5)


def test_correction_modes_off_and_tis():
    logp_old, logp_sparse = _example()
    w, mask, m = sparse_rl_correction(logp_old, logp_sparse, MASK, CorrectionConfig(mode="off"))
    torch.testing.assert_close(mask, MASK.float())
    torch.testing.assert_close(w, MASK.float())
    assert float(m["correction/vetoed_sequences"]) == 0
    w, mask, _ = sparse_rl_correction(
        logp_old, logp_sparse, MASK, CorrectionConfig(mode="tis", normalize=False)
    )
    torch.testing.assert_close(mask, MASK.float())
    truncated = torch.tensor(XI).clamp(max=1.5) * MASK
    torch.testing.assert_close(w, truncated, rtol=1e-5, atol=1e-7)


def test_log_ratio_clamp_keeps_weights_finite():
    logp_sparse = torch.tensor([[-1000.0, -1.0]])
    logp_old = torch.tensor([[-1.0, -1.0]])
    w, mask, m = sparse_rl_correction(logp_old, logp_sparse, torch.ones(1, 2))
    assert torch.isfinite(w).all() and torch.isfinite(m["correction/mismatch_kl"])
    assert float(m["correction/abs_logp_diff_max"]) == pytest.approx(999.0)  # the metric is unclamped
    cfg = CorrectionConfig(veto_threshold=0.0, reject_high=1e12, truncate_max=1e12, normalize=False)
    w, _, _ = sparse_rl_correction(logp_old, logp_sparse, torch.ones(1, 2), cfg)
    assert float(w[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_correction_pieces_with_global_totals_equal_whole_batch():
    """Split rows over 'ranks': local shares with global totals sum (or max) to the whole-batch values."""
    logp_old, logp_sparse = _example()
    w_all, mask_all, m_all = sparse_rl_correction(logp_old, logp_sparse, MASK)
    totals = CorrectionTotals.local(logp_old, logp_sparse, MASK)
    pieces, weights = [], []
    for rows in (slice(0, 1), slice(1, 3)):
        w, _, m = sparse_rl_correction(logp_old[rows], logp_sparse[rows], MASK[rows], totals=totals)
        pieces.append(m)
        weights.append(w)
    torch.testing.assert_close(torch.cat(weights), w_all)
    combined = reduce_metrics(pieces)
    for name, value in reduce_metrics([m_all]).items():
        assert combined[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "dense"}, "mode"),
        ({"reject_low": 2.0}, "reject_low"),
        ({"truncate_max": 0.0}, "truncate_max"),
    ],
)
def test_correction_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CorrectionConfig(**kwargs)


# --- policy loss --------------------------------------------------------------------------------
# old = 0, logp = log r.  seq0 (A=+1): r = [1.5, 0.9] -> [-1.2 (clipped), -0.9]
#                         seq1 (A=-1): r = [0.5, 1.1, 1.3] -> [0.8 (clipped), 1.1, 1.3]
#                         seq2: vetoed (mask all 0), counts in the seq-mean denominator
RATIOS = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.3], [1.0, 1.0, 1.0]])
PMASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]])
ADV = torch.tensor([1.0, -1.0, 1.0])


def _logp():
    return RATIOS.log().requires_grad_(True)


def test_policy_loss_clipping_and_aggregations_by_hand():
    logp = _logp()
    loss, m = policy_loss(logp, torch.zeros(3, 3), ADV, PMASK)
    seq0, seq1 = (-1.2 - 0.9) / 2, (0.8 + 1.1 + 1.3) / 3
    assert float(loss) == pytest.approx((seq0 + seq1) / 3, rel=1e-5)
    assert float(m["policy/clip_frac"]) == pytest.approx(2 / 5)
    loss.backward()
    # d/dlogp of -r*A (unclipped) is -r*A; clipped tokens have zero gradient.
    expected = torch.tensor([[0.0, -0.9 / 2, 0], [0, 1.1 / 3, 1.3 / 3], [0, 0, 0]]) / 3
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)

    tok, _ = policy_loss(
        _logp(), torch.zeros(3, 3), ADV, PMASK, cfg=PolicyLossConfig(aggregation="token_mean")
    )
    assert float(tok) == pytest.approx((-1.2 - 0.9 + 0.8 + 1.1 + 1.3) / 5, rel=1e-5)
    high, _ = policy_loss(_logp(), torch.zeros(3, 3), ADV, PMASK, cfg=PolicyLossConfig(clip_eps_high=0.4))
    assert float(high) == pytest.approx(((-1.4 - 0.9) / 2 + seq1) / 3, rel=1e-5)


def test_policy_loss_weights_kl_entropy_by_hand():
    weights = torch.tensor([[2.0, 1, 0], [1, 0.5, 1], [0, 0, 0]])
    logp_ref = torch.zeros(3, 3)
    entropy = torch.full((3, 3), 0.7)
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, m = policy_loss(_logp(), torch.zeros(3, 3), ADV, PMASK, weights, cfg, logp_ref, entropy=entropy)
    pg = ((-1.2 * 2 - 0.9) / 2 + (0.8 + 0.55 + 1.3) / 3) / 3
    k3 = [[1 / r + math.log(r) - 1 for r in row] for row in RATIOS.tolist()]  # d = -log r
    kl = ((k3[0][0] + k3[0][1]) / 2 + sum(k3[1]) / 3) / 3
    ent = (0.7 + 0.7) / 3
    assert float(m["policy/pg_loss"]) == pytest.approx(pg, rel=1e-5)
    assert float(m["policy/kl"]) == pytest.approx(kl, rel=1e-5)
    assert float(m["policy/entropy"]) == pytest.approx(ent, rel=1e-5)
    assert float(loss) == pytest.approx(pg + 0.1 * kl - 0.01 * ent, rel=1e-5)


def test_policy_loss_pieces_with_global_totals_sum_to_whole_batch():
    whole, m_all = policy_loss(_logp(), torch.zeros(3, 3), ADV, PMASK)
    totals = LossTotals.local(PMASK)
    rows = [slice(r, r + 1) for r in range(3)]
    parts = [policy_loss(_logp()[r], torch.zeros(1, 3), ADV[r], PMASK[r], totals=totals) for r in rows]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-6)
    combined = reduce_metrics(p[1] for p in parts)
    for name, value in reduce_metrics([m_all]).items():
        assert combined[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_policy_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        PolicyLossConfig(aggregation="sum")
