"""The trainer's weight sync into SGLang 0.5.23's REAL weight-update path on CPU.

Processes: a TP=1 and a TP=2 SGLang worker (tests/sglang_dense_world.py: SGLang's
`Qwen2ForCausalLM`, `WeightUpdater`, `SchedulerWeightUpdaterManager` and our loader through its
plugin, behind a stdlib HTTP front that parses bodies into SGLang's own `io_struct` classes), and
two learner ranks over gloo (tests/sglang_trainer_sync_worker.py: `build_learner` at TP=2 and
`WeightSyncer(remote_server="sglang")`). Each learner rank sends its own fragments, split per
SGLang TP rank; the host rank brackets each sync (ending a stale session first). Full syncs run
both ways: as fragments, and (`sync.broadcast`) as bucketed broadcasts from learner rank 0 over
SGLang's real weight-update group, each bucket reduced from both learner ranks' shards. After the full
sync, a sparse sync, a sparse sync that one worker rejects (full fallback), and two more after
that worker stopped (dropped, then skipped), every SGLang parameter must be bit-equal to SGLang's
own `load_weights` of the learner's HF export.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from e2e_support import free_port, make_assets, subprocess_env, write_config
from sglang_cpu import require_sglang
from test_sglang_dense import sglang_workers

from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.sglang.client import SGLangWorker
from sparserl_mcore.sglang.trainer_sync import split_even

HERE = Path(__file__).parent
BRACKET = [
    "/pause_generation",
    "/begin_weight_update",
    "/update_weights_from_tensor",  # learner rank 0's fragments (or rank 1's: they race)
    "/update_weights_from_tensor",
    "/end_weight_update",
    "/flush_cache",
    "/continue_generation",
]


@pytest.fixture(scope="module", params=["fragments", "broadcast"])
def found(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run per way full syncs travel: HTTP fragments, or `sync.broadcast` (gloo here)."""
    require_sglang()
    root = tmp_path_factory.mktemp(f"sglang-trainer-{request.param}")
    hf = make_assets(root)
    cfg = write_config(root, hf, "sglang", train={"micro_batch_size": 4})
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join((str(HERE.parent), str(HERE)))}
    with sglang_workers(root, hf, env) as (procs, urls):
        worker = str(HERE / "sglang_trainer_sync_worker.py")
        port = "-" if request.param == "fragments" else str(free_port())
        launch_local([worker, str(cfg), str(root), str(root), port, *urls], 2, env=env, timeout=400)
        for url in urls[1:]:  # the learners stopped worker 0 themselves
            with SGLangWorker(url, retries=0) as w:
                w._call("POST", "/shutdown", json={})
        for p in procs:
            log = p.communicate(timeout=60)[0].decode(errors="replace")
            assert p.returncode == 0, log[-3000:]
    return {**json.loads((root / "result.json").read_text()), "mode": request.param}


def _ranks(found: dict, version: int) -> list[dict]:
    return [rank for worker in found["checks"][str(version)] for rank in worker]


@pytest.mark.parametrize("version", [0, 1, 2, 4])
def test_every_sglang_parameter_is_bf16_of_the_learner(found, version):
    ranks = _ranks(found, version)
    assert len(ranks) == (3 if version < 4 else 2)  # TP=1 worker + both ranks of TP=2 (only those at v4)
    for rank in ranks:
        assert rank["params"] > 0 and rank["mismatched"] == [], rank["mismatched"]
        assert rank["receiver_version"] == version and rank["broken"] is None


def test_the_updates_moved_the_weights(found):
    assert found["updates"] == [2.0, 2.0], found["updates"]  # train.reuse_epochs=2, nothing gated
    assert all(b > 0 for b in found["patch_bytes"]), found["patch_bytes"]


def test_a_rejected_patch_gets_the_full_fallback_on_that_worker_only(found):
    events = found["events"][: len(found["events"]) - len(found["late_events"])]  # up to v2
    fallbacks = [d for kind, d in events if kind == "sync_fallback_full"]
    assert len(fallbacks) == 1 and len(fallbacks[0]["engines"]) == 1, events
    failed = [d for kind, d in events if kind == "sync_engine_failed"]
    assert [d["what"] for d in failed] == ["sparse weight sync"], failed  # the fallback landed
    assert "based on version 1, the receiver holds 99" in failed[0]["reason"], failed


def test_a_worker_failing_the_full_fallback_too_is_dropped_for_good(found):
    late = [(kind, d.get("what")) for kind, d in found["late_events"]]
    assert late == [
        ("sync_engine_failed", "sparse weight sync"),  # v3, worker 0 gone
        ("sync_fallback_full", None),
        ("sync_engine_failed", "full fallback sync"),
    ], late  # and nothing at v4: worker 0 is no longer sent to


def _syncs(routes: list[str]) -> list[list[str]]:
    """A rank's routes cut at each /check, without the probes (/health, /server_info) and /check."""
    out, current = [], []
    for route in routes:
        if route == "/check":
            out.append(current)
            current = []
        elif route not in ("/health", "/server_info"):
            current.append(route)
    return out


def _full_bracket(found: dict) -> list[str]:
    if found["mode"] == "fragments":  # each of the 2 learner ranks sends its share in 3 pieces
        assert found["pieces"] == 3
        return [*BRACKET[:2], *["/update_weights_from_tensor"] * 6, *BRACKET[4:]]
    assert found["buckets"] > 3  # 48 KiB buckets, each one broadcast from learner rank 0
    return [
        *BRACKET[:2],
        "/init_weights_update_group",
        *["/update_weights_from_distributed"] * found["buckets"],
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",  # the version marker, through our loader
        *BRACKET[4:],
    ]


def test_each_sync_is_one_bracket_in_order(found):
    full_bracket = _full_bracket(found)
    marker = [*BRACKET[:3], "/end_weight_update", "/continue_generation"]  # the test's planted version
    for index, worker in enumerate(found["checks"]["2"]):
        for rank in worker:
            full, sparse, rejected = _syncs(rank["routes"])
            # worker 1: the stale session, refused by begin, ended, then begun again
            stale = ["/begin_weight_update", *BRACKET[:2], "/end_weight_update", *full_bracket[1:]]
            assert full == (stale if index == 1 else full_bracket) and sparse == BRACKET, (full, sparse)
            # worker 0: the planted marker, the rejected v2 bracket, then its full-fallback bracket
            assert rejected == (marker + BRACKET + full_bracket if index == 0 else BRACKET), rejected


def test_a_full_sync_is_cut_into_equal_pieces_even_when_short():
    changes = [("a", np.arange(5), None, np.arange(5)), ("b", np.arange(3), np.arange(3), np.arange(3))]
    for pieces, sizes in ((1, [8]), (3, [3, 3, 2]), (9, [1] * 8 + [0])):
        parts = split_even(changes, pieces)
        assert [sum(len(c[1]) for c in p) for p in parts] == sizes
        names = [(name, int(i)) for part in parts for name, idx, _, _ in part for i in idx]
        assert names == [("a", i) for i in range(5)] + [("b", i) for i in range(3)]  # each once, in order
    assert split_even([], 2) == [[], []]


def test_every_rank_assembles_buckets_in_one_reused_buffer(tmp_path):
    """`BucketReducer` on 2 learner ranks over gloo: every bucket reaches the host bit for bit,
    and no rank ever holds more than one bucket (one buffer of the largest, reused), where a fresh
    bucket per reduce lets a rank that is not the host hold every bucket until the host reaches it."""
    launch_local([str(HERE / "bucket_reduce_worker.py"), str(tmp_path)], 2, env=subprocess_env(), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["buckets"] >= 4 and ranks[0]["equal"] == [True] * ranks[0]["buckets"]
    for found in ranks:
        assert found["storages"] == 1  # every bucket a view of the same buffer
        assert found["buffer_bytes"] == found["largest_bucket"] < found["state_bytes"] / 2
