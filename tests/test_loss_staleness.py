"""Asynchronous RL in the loss: version lags by hand, too-stale tokens masked and counted, the
mismatch split by lag, and the synchronous loss as the special case staleness 0, bit for bit, through
megatron-core's real update (one CPU process)."""

from __future__ import annotations

import math

import pytest
import torch

from sparserl_mcore.loss import staleness
from sparserl_mcore.loss.totals import reduce_metrics
from sparserl_mcore.trainer.versions import KEEP, PolicyVersions


def test_lag_counts_published_versions_not_steps():
    versions = PolicyVersions([0, 2, 3])  # step 1 published nothing (all its updates gated)
    tokens = torch.tensor([[0, 2, 3], [3, 3, 0]])
    assert versions.lag(tokens).tolist() == [[2, 1, 0], [0, 0, 2]]
    versions.publish(5)
    assert versions.current == 5 and versions.lag(torch.tensor([0, 3, 5])).tolist() == [3, 1, 0]
    with pytest.raises(ValueError, match="not newer"):
        versions.publish(5)
    long = PolicyVersions(range(KEEP + 10))
    assert long.lag(torch.tensor([0])).item() == KEEP  # older than the kept history: saturates
    with pytest.raises(ValueError, match="increasing"):
        PolicyVersions([3, 1])


def test_lag_metrics_by_hand():
    """Two sequences, lags 0/1/2 with eta = 1: the lag-2 token is masked and counted; the k3 mismatch
    is reported per lag, the lag-0 one as the compression mismatch at equal version."""
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    lag = torch.tensor([[9, 0, 1, 2], [9, 0, 1, 7]])  # 9 and 7 sit outside the mask: ignored
    logp_prox = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0, -2.0, -0.5, 0]])
    logp_behavior = torch.tensor([[0.0, -1.1, -1.5, -3.0], [0, -2.0, -0.4, 0]])
    kept = staleness.drop_stale(mask, lag, max_staleness=1)
    assert kept.tolist() == [[0, 1, 1, 0], [0, 1, 1, 0]]

    def k3(d: float) -> float:
        return math.exp(d) - 1 - d

    pieces = staleness.lag_pieces(logp_prox, logp_behavior, mask, lag, max_staleness=1)
    out = staleness.lag_metrics(reduce_metrics([pieces]), max_staleness=1)
    assert out["staleness/tokens_lag0"] == 2 and out["staleness/tokens_lag1"] == 2
    assert out["staleness/masked_tokens"] == 1 and out["staleness/lag_max"] == 2
    assert out["staleness/lag_mean"] == pytest.approx((0 + 1 + 2 + 0 + 1) / 5)
    assert out["staleness/mixed_sequences"] == 2  # both rows span versions (outside the mask: ignored)
    lag0 = (k3(0.1) + k3(0.0)) / 2
    lag1 = (k3(0.5) + k3(-0.1)) / 2
    assert out["mismatch/kl_lag0"] == pytest.approx(lag0, rel=1e-5) == out["mismatch/compression_kl"]
    assert out["mismatch/kl_lag1"] == pytest.approx(lag1, rel=1e-5)
    assert out["mismatch/version_lag_kl"] == pytest.approx(lag1 - lag0, rel=1e-4)
    assert not any(k.startswith("mismatch/k3_sum") for k in out)
    # one_step mode: every token lags 1, there is no equal-version token to compare against
    ones = staleness.lag_metrics(
        reduce_metrics([staleness.lag_pieces(logp_prox, logp_behavior, mask, torch.ones_like(lag), 1)]), 1
    )
    assert "mismatch/compression_kl" not in ones and "mismatch/version_lag_kl" not in ones
    assert ones["staleness/tokens_lag1"] == 5 and ones["staleness/mixed_sequences"] == 0


# --- through megatron-core's update -------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    from single_process import cpu_runtime

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    hf = make_tiny(
        TinyModelConfig(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128),
        tmp_path_factory.mktemp("tiny") / "hf",
    )
    with cpu_runtime(seed=5) as rt:
        yield rt, hf


def _learner(rt, hf, max_staleness):
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.trainer.setup import build_learner

    overrides = ["train.async.mode=in_flight", f"train.async.max_staleness={max_staleness}"]
    cfg = config_from_dict(
        {
            "model": {"hf_path": str(hf), "params_dtype": "fp32"},
            "data": {"train_path": "unused.jsonl"},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "train": {
                "prompts_per_step": 2,
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "reuse_epochs": 2,
            },
            "rollout": {"group_size": 4},
            "loss": {"policy": {"kl_coef": 0.0}},
        },
        overrides if max_staleness is not None else [],
    )
    return build_learner(cfg, rt)


def _update(learner, rt, batch):
    from sparserl_mcore.loss import megatron_step

    result = megatron_step.train_on_batch(
        learner.model,
        learner.optimizer,
        batch,
        cfg=learner.update_cfg,
        gate=learner.gate,
        runtime=rt,
        scheduler=learner.scheduler,
    )
    params = {n: p.detach().clone() for n, p in learner.model.module.named_parameters()}
    return result.metrics, params


@pytest.fixture(scope="module")
def behavior(runtime):
    """Tokens and a behavior policy a little off the learner's initial one (what compression and
    staleness both do), inside Sparse-RL's rejection band so the tokens train."""
    from sparserl_mcore.loss import megatron_step

    rt, hf = runtime
    learner = _learner(rt, hf, None)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 90, (8, 14), generator=g)
    cfg = learner.update_cfg
    logp = megatron_step.compute_logprobs(
        learner.model, tokens, micro_batch_size=4, temperature=1.0, vocab_size=cfg.vocab_size, runtime=rt
    )
    return tokens, logp + 0.3 * (torch.rand(8, 14, generator=g) - 0.5), torch.randn(8, generator=g)


def _batch(behavior, lag=None, keep=None):
    from sparserl_mcore.loss import megatron_step

    tokens, logp_behavior, advantages = behavior
    mask = torch.ones(8, 14)
    mask[:, :4] = 0
    if keep is not None:
        mask = mask * keep
    return megatron_step.UpdateBatch(
        tokens_BT=tokens,
        mask_BT=mask,
        advantages_B=advantages,
        logp_sparse_BT=logp_behavior * mask,
        lag_BT=lag,
    )


def test_staleness_zero_is_the_synchronous_update_bit_for_bit_and_stale_tokens_are_masked(runtime, behavior):
    rt, hf = runtime
    zeros = torch.zeros(8, 14, dtype=torch.long)
    sync_metrics, sync_params = _update(_learner(rt, hf, None), rt, _batch(behavior))
    fresh_metrics, fresh_params = _update(_learner(rt, hf, 2), rt, _batch(behavior, zeros))
    assert sync_metrics["correction/kept_token_frac"] == 1.0 and sync_metrics["train/updates"] == 2
    for name, value in sync_params.items():
        assert torch.equal(fresh_params[name], value), name
    assert {k: v for k, v in fresh_metrics.items() if k in sync_metrics} == sync_metrics
    assert fresh_metrics["staleness/masked_tokens"] == 0 and fresh_metrics["staleness/tokens_lag0"] == 80

    # lag 3 > eta = 2 on part of the batch: exactly the update whose mask never had those tokens
    lag = torch.zeros(8, 14, dtype=torch.long)
    lag[:3, 9:] = 3
    lag[5, 6:] = 1
    stale_metrics, stale_params = _update(_learner(rt, hf, 2), rt, _batch(behavior, lag))
    assert stale_metrics["staleness/masked_tokens"] == 15 and stale_metrics["staleness/tokens_lag1"] == 8
    ref_metrics, ref_params = _update(_learner(rt, hf, None), rt, _batch(behavior, keep=lag <= 2))
    for name, value in ref_params.items():
        assert torch.equal(stale_params[name], value), name
    assert stale_metrics["policy/loss"] == ref_metrics["policy/loss"]
    assert stale_metrics["policy/loss"] != sync_metrics["policy/loss"]  # the masking did change it
    assert any(not torch.equal(stale_params[n], p) for n, p in sync_params.items())


def test_update_batch_refuses_lag_without_staleness_bound(runtime, behavior):
    rt, hf = runtime
    learner = _learner(rt, hf, None)
    with pytest.raises(ValueError, match="lag_BT and UpdateConfig.max_staleness go together"):
        _update(learner, rt, _batch(behavior, torch.zeros(8, 14, dtype=torch.long)))
    with pytest.raises(ValueError, match="lag_BT has shape"):
        _update(learner, rt, _batch(behavior, torch.zeros(8, 13, dtype=torch.long)))
