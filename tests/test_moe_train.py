"""GRPO on a Qwen3-MoE policy at EP=2 and TP=2 x EP=2 equals the single-process reference, and a
checkpoint saved at EP=2 resumes at EP=1.

tests/moe_train_worker.py runs the trainer's learner (DDP, distributed optimizer over dense and
expert parameters, Adam, clipping; aux loss on) through two rollout batches with Sparse-RL
correction, KL, entropy and DGG: 5 optimizer updates. Launches: EP=2 on 2 ranks (saving a training
checkpoint after the first batch), TP=2 x EP=2 on 4 ranks (sequence parallel, all-to-all
dispatcher), and one plain process running the EP=1 reference and then, from the EP=2 checkpoint,
the second batch again. Compared: every metric of every update, the DGG energies, the routing
tables (tokens per expert per layer: exact), the aux loss, and the trained weights exported as HF
safetensors.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("moe_train_worker.py"))
TOL = 1e-5
WEIGHT_ATOL = 3e-5  # Adam at lr 1e-3 moves weights ~1e-3 per update: a layout bug moves them that much
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("moe_train")
    hf = str(make_tiny(TinyModelConfig(arch="qwen3_moe", vocab=100, seed=5), tmp / "qwen3_moe"))
    ckpt = tmp / "ckpt"
    launch_local(
        [WORKER, str(tmp / "ep2"), hf, "--ep", "2", "--save", str(ckpt)], 2, env=CPU_ONLY, timeout=600
    )
    launch_local([WORKER, str(tmp / "tp2ep2"), hf, "--ep", "2", "--tp", "2"], 4, env=CPU_ONLY, timeout=600)
    env = {**os.environ, **CPU_ONLY, "OMP_NUM_THREADS": "1"}
    for name, extra in (("ref", []), ("resumed_ep1", ["--resume", str(ckpt / "step_00000001")])):
        run = subprocess.run(
            [sys.executable, WORKER, str(tmp / name), hf, *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for name in ("ref", "ep2", "tp2ep2", "resumed_ep1"):
        result = torch.load(tmp / name / "result.pt", weights_only=False)
        result["weights"] = {
            k: v for f in sorted((tmp / name / "hf").glob("*.safetensors")) for k, v in load_file(f).items()
        }
        out[name] = result
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a))


def test_reference_exercises_the_moe_update(runs):
    ref = runs["ref"]["steps"]
    first = ref[0]["metrics"]
    assert first["correction/vetoed_sequences"] == 1 and first["correction/rejected_token_frac"] > 0
    assert first["policy/kl"] > 0 and len(ref[1]["updates"]) == 4
    for step in ref:
        table = step["routing"]
        assert table.shape == (2, 4) and (table > 0).all()  # 2 layers x 4 experts, every expert used
        # each routed token goes to top_k = 2 experts; every pass of an update routes its tokens once
        assert table.sum() % 2 == 0 and table[0].sum() == table[1].sum()
        metrics = step["routing_metrics"]
        assert metrics["moe/load_imbalance"] > 1 and 0 < metrics["moe/expert_load_min"] < 1
        assert 1 < metrics["moe/aux_loss"] < 4  # switch loss: 1 when balanced, E/top_k at worst


@pytest.mark.parametrize(("layout", "first"), [("ep2", 0), ("tp2ep2", 0), ("resumed_ep1", 1)])
def test_layout_matches_single_process(runs, layout, first):
    ref, got = runs["ref"]["steps"][first:], runs[layout]["steps"]
    assert len(got) == len(ref)
    for want, have in zip(ref, got, strict=True):
        for a, b in zip(
            [want["metrics"], *want["updates"]], [have["metrics"], *have["updates"]], strict=True
        ):
            assert a.keys() == b.keys()
            bad = {k: (a[k], b[k]) for k in a if not _close(a[k], b[k])}
            assert not bad, f"{layout}: {bad}"
        assert all(_close(a, b) for a, b in zip(want["energies"], have["energies"], strict=True)), layout
        assert (want["routing"] == have["routing"]).all(), f"{layout}: routing differs"
        assert all(_close(a, b) for a, b in zip(want["aux_loss"], have["aux_loss"], strict=True))
    ref_weights, weights = runs["ref"]["weights"], runs[layout]["weights"]
    assert sorted(weights) == sorted(ref_weights)
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=0, atol=WEIGHT_ATOL, msg=f"{layout} {name}")
