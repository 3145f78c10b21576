"""The trainer's collectives use the learner group they are given, never the world group: 3 gloo
ranks under torchrun, 2 of them learners (tests/groups_worker.py). A collective on the world group
would wait for the third rank forever, so the run would time out."""

from __future__ import annotations

import json
import pathlib

from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("groups_worker.py"))


def test_learner_collectives_stay_in_the_learner_group(tmp_path):
    launch_local([WORKER, str(tmp_path)], 3, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=240)
    host, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert not (tmp_path / "rank2.json").exists()
    assert host["agree_or"] is True and other["agree_or"] is True  # rank 1's True reached rank 0
    assert host["agree_none"] is False and other["agree_none"] is False
    # the host generated (prompt ids + 1, two samples per prompt) and scored; rank 1 got the same
    assert host["outputs"] == [[4, 5, 6], [4, 5, 6], [8], [8]] == other["outputs"]
    assert host["rewards"] == [16.0, 16.0, 8.0, 8.0] == other["rewards"]
    assert host["eval"] == {"eval/pass1_compressed": 12.0} == other["eval"]
