"""megatron's distributed optimizer with bf16 params + fp32 master weights, on CPU over gloo.

Possible since `parallel.cpu_mode` reports CUDA type names (its point 4). One reference process
(plain mixed-precision optimizer) and one DP=2 torchrun job (distributed optimizer) of
tests/distopt_worker.py train the same tiny model on the same batches (3 plain LM steps, then one
RL update of `loss.megatron_step.train_on_batch`: K=2 epochs x 2 minibatches with DGG); the DP=2
job also checks the learner-side sparse sync after every version against a full HF export (see the
worker's docstring). Here: the DP=2 BF16 weights equal the reference bit for bit after every
version, the DP-shard branch of `loss.lm_head_grad_energy` gives the single-process energy, and the
RL update's metrics match (the DWD weight change on the DP shards of the fp32 main weights among them).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.sync.hf_files import load_state

WORKER = pathlib.Path(__file__).with_name("distopt_worker.py")
STEPS, SEQ, VOCAB = 3, 17, 100  # VOCAB: that of tests/loss_dist_worker.py's rollout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("distopt")
    # vocab 100 pads to 128 rows: padding rows must stay out of the sync and the energy
    hf_dir = make_tiny(TinyModelConfig(vocab=VOCAB, dtype="bfloat16"), work / "hf")
    gen = torch.Generator().manual_seed(5)
    batches = torch.randint(0, VOCAB, (STEPS, 2, SEQ), generator=gen).tolist()
    (work / "plan.json").write_text(json.dumps({"hf_dir": str(hf_dir), "batches": batches}))
    ref = subprocess.run(
        [sys.executable, str(WORKER), str(work)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr
    launch_local([str(WORKER), str(work)], 2, timeout=300)
    return work


def _result(work: pathlib.Path, mode: str) -> dict:
    return json.loads((work / f"{mode}.json").read_text())


def _rows(work: pathlib.Path, mode: str) -> list[dict]:
    rows = _result(work, mode)["lm_steps"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def test_distributed_optimizer_bf16_weights_match_single_process_bitwise(runs):
    initial = load_state(runs / "hf")
    for step in range(1, STEPS + 2):  # the LM steps, then the RL update's 4 optimizer steps
        ref, got = load_state(runs / "ref" / f"v{step}"), load_state(runs / "dist" / f"v{step}")
        assert set(ref) == set(got) == set(initial)
        assert all(t.dtype == torch.bfloat16 for t in got.values())
        differ = [n for n in ref if not torch.equal(ref[n].view(torch.int16), got[n].view(torch.int16))]
        assert not differ, f"step {step}: BF16 weights differ from the reference in {differ[:3]}"
        # the model really trained: most tensors moved since the start
        moved = sum(not torch.equal(got[n], initial[n]) for n in got)
        assert moved > len(got) // 2, (step, moved)
    for ref, got in zip(_rows(runs, "ref"), _rows(runs, "dist"), strict=True):
        # same fp32 gradients; megatron's fp32 norm is summed in a different order over the shards
        assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5), (ref, got)


def test_lm_head_grad_energy_dp_shards_equal_single_process(runs):
    for ref, got in zip(_rows(runs, "ref"), _rows(runs, "dist"), strict=True):
        assert ref["energy"] > 0
        # bit-identical fp32 gradients; only the fp64 sum is split into two shards
        assert math.isclose(got["energy"], ref["energy"], rel_tol=1e-12), (ref, got)


def test_sparse_sync_with_distributed_optimizer_matches_export(runs):
    # the worker asserted per step: receiver == export bit for bit, patch elements == changed elements
    rows = _rows(runs, "dist")
    assert all(r["changed"] > 0 and r["patch_bytes"] > 0 for r in rows), rows


def test_rl_update_with_dgg_under_distributed_optimizer_matches_single_process(runs):
    ref, got = _result(runs, "ref")["rl_update"], _result(runs, "dist")["rl_update"]
    assert got["metrics"].keys() == ref["metrics"].keys() and got["metrics"]["train/updates"] == 4
    # the DWD signal (fp32 main weights: the DP shards of the distributed optimizer vs the mixed-
    # precision optimizer's full fp32 copy) is among the metrics compared below
    assert ref["metrics"]["dwd/lm_head_rel_change"] > 0 and ref["metrics"]["dwd/middle_rel_change"] > 0
    for key, value in ref["metrics"].items():
        assert math.isclose(got["metrics"][key], value, rel_tol=1e-9, abs_tol=1e-12), key
    assert all(
        math.isclose(g, r, rel_tol=1e-12) for g, r in zip(got["energies"], ref["energies"], strict=True)
    )
    assert all(
        math.isclose(g, r, rel_tol=1e-5) for g, r in zip(got["grad_norms"], ref["grad_norms"], strict=True)
    )
    assert got["changed"] > 0  # and the worker checked the sync after it against the export
