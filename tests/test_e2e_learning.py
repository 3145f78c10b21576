"""GRPO learns, end to end: `sparserl train` on a random tiny Qwen2 with an easy verifiable reward
(the share of lowercase letters in the completion, ~0.25 for the random policy) must raise the
step reward by a clear margin within a few steps, with dense rollouts and with SnapKV-compressed
rollouts under the Sparse-RL correction, and asynchronously (`train.async`: one-step-off, and in
flight) with SnapKV under the one correction that covers compression and staleness. A loop that
does not learn (a sign error in the advantages, weights that never reach the engine, a correction
that masks everything, batches trained against the wrong versions) fails it.
"""

from __future__ import annotations

import statistics

import pytest
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local

TRAIN = str(REPO / "launchers" / "train.py")
# Mean reward of the last 2 steps minus the first 2. Measured (12 steps, seeded): 0.247 -> 0.800
# dense, 0.240 -> 0.791 SnapKV-compressed; asynchronous with SnapKV, one-step-off and in flight
# (max_staleness 1) alike, 0.237 -> 0.697 (first 2 / last 2 step means: the policy that samples is
# one version behind). In flight with max_staleness 2 the same run reached only 0.237 -> 0.467 in 12
# steps at this test's lr 3e-3 (15-30 % of the 2-versions-old tokens leave Sparse-RL's rejection
# band): why the in-flight case runs at 1. A run that stops learning half-way stays under it.
# No sequence spans two versions here (staleness/mixed_sequences 0 in all 12 steps): each batch
# finishes generating within the update it overlaps (generate 0.2-1.0 s, update 0.25-1.1 s, the two
# sharing the CPU). Longer samples stretch both and learn less in 12 steps (24 tokens: rise 0.13, no
# mixed sequence; 36: rise 0.26, mixed in 2 of 12 steps), so updates landing inside sequences are
# checked in a generation-bound run instead (tests/test_e2e_async.py).
MARGIN = 0.4
ASYNC = {"off": {"mode": "off"}, "one_step": {"mode": "one_step"}, "in_flight": {"mode": "in_flight"}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kv, mode", [("none", "off"), ("snapkv", "off"), ("snapkv", "one_step"), ("snapkv", "in_flight")]
)
def test_a_short_grpo_run_raises_an_easy_reward(tmp_path, kv, mode):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        kv,
        parallel={"tensor_model_parallel_size": 1},
        rollout={
            "group_size": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True},
            "kv": {"method": kv, "budget": 8, "interval": 2, "window": 2, "kernel_size": 3},
        },
        loss={"policy": {"kl_coef": 0.0}, "correction": {"mode": "sparse_rl" if kv != "none" else "off"}},
        train={"steps": 12, "async": ASYNC[mode]},
        checkpoint={"every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    launch_local([TRAIN, "--config", str(cfg)], 1, env=subprocess_env(), timeout=240)
    records = [r for r in metrics(tmp_path, kv) if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 12, rewards
    if kv != "none":
        assert all(r["rollout/peak_kv_bytes"] < r["rollout/dense_kv_bytes"] for r in records)
    rise = statistics.fmean(rewards[-2:]) - statistics.fmean(rewards[:2])
    assert rise >= MARGIN, rewards
    if mode != "off":  # within the staleness bound, nothing masked, and stale tokens really trained
        eta = ASYNC[mode].get("max_staleness", 1)
        assert all(r["staleness/lag_max"] <= eta and r["staleness/masked_tokens"] == 0 for r in records)
        assert sum(r["staleness/tokens_lag1"] for r in records) > 0
