"""Islands x asynchronous rollouts end to end on CPU: `sparserl train` with 2 DiLoCo islands of one
rank each (gloo), at max_staleness 1 in flight and one-step-off, outer step every 6 updates.

The demo-shaped loop makes 4 optimizer updates per RL step, so step 1 makes no outer step, steps 2
and 3 make one (updates 6 and 12) and step 4 closes the round (update 16). The rule (docs/islands.md,
"Asynchronous rollouts"): the engines only ever receive agreed weights, so a version is published
exactly at the RL steps with an outer step (what such a sync ships is bf16 of the anchor:
`tests/test_diloco_islands.py::test_engines_get_the_agreed_weights_not_an_islands_own`), and the
staleness of a trained token counts those agreed versions, never RL steps or an island's local
updates. Checked against that rule:
- a version is published (synced) at exactly the steps with an outer step;
- batch 2 was admitted at the start of step 1 and trained at step 2; step 1 published nothing, so
  its tokens lag 0 agreed versions (counted in RL steps, or with the islands' local weights
  synced every step, they would lag 1);
- every trained token is within max_staleness and counted in the histogram, none is masked, and
  the bound is reached (batch 3 was admitted before the sync of step 2 and trained after it).
  The staleness metrics are island 0's, as `policy/*` are (reduced over the island's replicas);
  island 1 trains the other half of the same broadcast batch against the same version table;
- one_step: each agreed sync waits for the batch in flight, so no sequence mixes versions, and the
  lags are exactly 0, 0, 1, 1 (steps 3 and 4 train batches admitted one agreed version earlier).
With `train.async.mode: off` the loop's islands path is unchanged (tests/test_e2e_islands.py).
"""

from __future__ import annotations

import pytest
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local

TRAIN = str(REPO / "launchers" / "train.py")
TOKENS, ETA = 12, 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["in_flight", "one_step"])
def test_async_islands_roll_out_agreed_versions_only_and_count_staleness_in_them(tmp_path, mode):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "run",
        parallel={"tensor_model_parallel_size": 1, "islands": 2},
        diloco={"inner_steps": 6},
        train={
            "steps": 4,
            "prompts_per_step": 4,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "reuse_epochs": 2,
            "filter_zero_variance_groups": False,  # every step trains all 32 sequences: 4 updates
            "async": {"mode": mode, "max_staleness": ETA},
        },
        checkpoint={"dir": None, "every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    launch_local([TRAIN, "--config", str(cfg)], 2, env=subprocess_env(), timeout=400)
    rows = metrics(tmp_path, "run")
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["train/updates"] == 4 for r in steps)
    outer_steps = [r["step"] for r in steps if r.get("diloco/outer_steps", 0) > 0]
    assert outer_steps == [2, 3, 4]
    # a sync (a published version) exactly where the islands agreed, and nowhere else
    assert [r["step"] for r in steps if "time/sync_s" in r] == outer_steps
    assert [r["step"] for r in steps if "sync/patch_bytes" in r] == outer_steps
    for r in steps:
        histogram = sum(r[f"staleness/tokens_lag{k}"] for k in range(ETA + 1))
        assert r["staleness/lag_max"] <= ETA and r["staleness/masked_tokens"] == 0, r
        assert histogram == r["train/sequences"] / 2 * TOKENS, r  # island 0's half (policy/* too)
    assert steps[1]["staleness/lag_max"] == 0  # one RL step ahead, zero agreed versions behind
    assert sum(r[f"staleness/tokens_lag{ETA}"] for r in steps) > 0  # the bound is reached
    if mode == "one_step":
        assert [r["staleness/lag_max"] for r in steps] == [0, 0, 1, 1]
        assert [r["staleness/lag_mean"] for r in steps] == [0, 0, 1, 1]
        assert all(r["staleness/mixed_sequences"] == 0 for r in steps)
