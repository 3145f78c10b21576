"""In-flight weight syncs (`train.async.mode=in_flight`) that fail, and the prefix-cache key of
SGLang requests, through the trainer's own `WeightSyncer` (tests/inflight_sync_worker.py: one
learner rank over gloo, a real `sparserl serve` app on loopback, a stand-in SGLang worker).

- A server that failed a delivery may hold part of the version (the fragments of some learner
  ranks): it stays paused until its full fallback lands, then continues; one that fails the
  fallback too is dropped, and what it runs is aborted, then it continues: no token is decoded on
  weights it could not take, no request waits on it. `sparserl serve` refusing by itself (it holds
  another version) and refusing patches; the SGLang bracket the same, seen in the worker's routes.
- The SGLang prefix key (`extra_key`) of a version is set while the workers are paused for it:
  a request sent the moment generation continues carries the new version's key, not the old one
  (with the new weights it would match the prefix KV the old ones computed, labelled lag 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from e2e_support import make_assets, subprocess_env, write_config

from sparserl_mcore.parallel.launch import launch_local

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("inflight-sync")
    hf = make_assets(root)
    cfg = write_config(root, hf, "inflight", parallel={"tensor_model_parallel_size": 1})
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join((str(HERE.parent), str(HERE)))}
    launch_local([str(HERE / "inflight_sync_worker.py"), str(cfg), str(root)], 1, env=env, timeout=300)
    return json.loads((root / "result.json").read_text())


def test_a_server_that_failed_a_delivery_stays_paused_until_its_fallback_lands(found):
    for version in ("v1", "v2"):  # v1: the server refused (it held v99); v2: patches refused
        events, info = found[version]["events"], found[version]["info"]
        assert [e[0] for e in events] == ["sync_engine_failed", "sync_fallback_full"], events
        assert events[1][2] is True, f"{version}: continued before its fallback landed"
        assert info["paused"] is False and info["weight_version"] == int(version[1]), info


def test_a_server_dropped_after_its_fallback_aborts_what_it_ran_and_continues(found):
    v3 = found["v3"]
    assert [e[:2] for e in v3["events"]] == [
        ["sync_engine_failed", "sparse weight sync"],
        ["sync_fallback_full", None],
        ["sync_engine_failed", "full fallback sync"],
    ], v3["events"]
    assert v3["events"][1][2] is True  # paused through the fallback
    assert v3["info"]["paused"] is False  # not left paused once dropped
    [(finish, tokens)] = v3["answer"]
    assert finish == "abort" and tokens < 1500, v3["answer"]


def _brackets(log: list) -> list[list]:
    """The stand-in's routes cut after each /continue_generation (with the /generate it triggered)."""
    out, current = [], []
    for route, detail in log:
        current.append([route, detail])
        if route == "/generate":
            out.append(current)
            current = []
    assert current == []
    return out


def test_a_failed_sglang_worker_stays_paused_until_its_fallback_lands_or_it_is_dropped(found):
    paused, opened = ["/pause_generation", "in_place"], ["/begin_weight_update", None]
    sent, closed = ["/update_weights_from_tensor", None], ["/end_weight_update", None]
    refused = ["/update_weights_from_tensor", True]
    go = ["/continue_generation", None]
    brackets = [[step for step in b if step[0] != "/generate"] for b in _brackets(found["sglang_log"])]
    assert brackets[:2] == [[paused, opened, sent, closed, go]] * 2  # v0 (full), v1
    # v2: refused, no continue before the fallback's bracket; v3: refused twice, dropped, aborted
    assert brackets[2] == [paused, opened, refused, closed, paused, opened, sent, closed, go]
    abort = ["/pause_generation", "abort"]
    assert brackets[3] == [paused, opened, refused, closed, paused, opened, refused, closed, abort, go]
    assert len(brackets) == 4


def test_a_request_sent_as_sglang_continues_carries_the_new_versions_prefix_key(found):
    keys = [b[-1][1] for b in _brackets(found["sglang_log"])]
    assert keys == [[found["keys"][str(v)]] for v in range(4)], keys
