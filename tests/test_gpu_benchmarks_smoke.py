"""The GPU benchmarks' code paths, run in --smoke mode (tiny shapes) on whatever device is here, so
they do not rot between GPU runs. Their figures mean nothing and are not looked at; what is
checked is that every table is produced and the sync benchmark's receiver ends bit-identical."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu import engine, learner, logprob, sync


@pytest.mark.parametrize(
    "bench", [learner, logprob, sync, engine], ids=["learner", "logprob", "sync", "engine"]
)
def test_gpu_benchmark_runs_in_smoke_mode(tmp_path, bench):
    name = bench.__name__.rsplit(".", 1)[1]
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["rows"] and record["environment"]["torch"] != "absent"
    assert any("SMOKE" in note for note in record["notes"])
    if name == "sync":
        assert "receiver bit-identical: True" in record["notes"]
        assert {r["path"] for r in record["rows"]} == {"trainer (flat, per rank)", "make_patch (host)"}
    if name == "logprob":
        assert {row["path"] for row in record["rows"]} >= {"today", "fused"}
    if name == "learner":
        assert {row["step"] for row in record["rows"]} == {"fwd+bwd+adam", "rl update"}
