"""Sparse sync of a Qwen3-MoE learner at EP=2 into SGLang 0.5.23's fused experts, bit for bit.

Learner (tests/moe_sync_worker.py, 2 ranks, megatron EP=2): each rank snapshots its bf16 shard of
checkpoint A, loads B in place (one-ulp changes scattered over every tensor, experts included) and
takes its own changes in HF coordinates (`ShardSyncer.local_changes`), then encodes its fragments
per SGLang TP rank. SGLang (tests/sglang_moe_worker.py): SGLang's real `Qwen3MoeForCausalLM` at TP=2
with --ep-size 2 (each rank two whole experts) and with --ep-size 1 (each expert split over both
ranks' `w13_weight` / `w2_weight`), loaded with A by SGLang's own `load_weights`, receives the
fragments through SGLang's `WeightUpdater` and our loader; every parameter must equal SGLang's own
load of B. SGLang's MoE block then runs (its CPU path) on the synced weights and must agree with HF
transformers' block on B (at --ep-size 1; SGLang's CPU MoE path cannot run EP > 1, see
tests/sglang_moe_worker.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from e2e_support import free_port
from safetensors.torch import load_file, save_file
from sglang_cpu import require_sglang

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.sync.hashing import bits_view

HERE = pathlib.Path(__file__).parent
RECEIVERS = ((2, 2), (2, 1))  # SGLang (TP, EP)


def _perturbed(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """B: A with ~2 % of every tensor's elements moved one bf16 ulp."""
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(9)
    for name in sorted(state):
        flat = bits_view(state[name])
        idx = torch.randperm(flat.size, generator=gen)[: max(1, flat.size // 50)].numpy()
        flat[idx] = flat[idx] + np.uint16(1)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> dict:
    require_sglang()
    root = tmp_path_factory.mktemp("moe_sync")
    hf_a = make_tiny(TinyModelConfig(arch="qwen3_moe", vocab=130, dtype="bfloat16", seed=4), root / "a")
    hf_b = _perturbed(hf_a, root / "b")
    frags = root / "frags"
    frags.mkdir()
    specs = [f"{tp},{ep}" for tp, ep in RECEIVERS]
    launch_local([str(HERE / "moe_sync_worker.py"), str(hf_a), str(hf_b), str(frags), *specs], 2, timeout=600)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "CUDA_VISIBLE_DEVICES": ""}
    procs = {}
    for tp, ep in RECEIVERS:
        port = free_port()
        for rank in range(tp):
            out = root / f"sglang_tp{tp}_ep{ep}_r{rank}.json"
            cmd = [sys.executable, str(HERE / "sglang_moe_worker.py"), str(rank), str(tp), str(port), str(ep)]
            cmd += [str(hf_a), str(hf_b), str(frags), str(out)]
            procs[tp, ep, rank] = (
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
                out,
            )
    found: dict = {"a": hf_a, "b": hf_b, "learner": torch.load(frags / "changes.pt", weights_only=False)}
    for (tp, ep, rank), (proc, out) in sorted(procs.items()):
        log = proc.communicate(timeout=600)[0].decode(errors="replace")
        assert proc.returncode == 0, f"SGLang TP={tp} EP={ep} rank {rank} failed:\n{log[-3000:]}"
        found[tp, ep, rank] = json.loads(out.read_text())
        if rank == 0 and ep == 1:
            found[tp, ep, "forward"] = torch.load(out.with_suffix(".pt"), weights_only=True)
    return found


def test_learner_ranks_report_each_change_once_in_hf_coordinates(synced):
    a = load_file(synced["a"] / "model.safetensors")
    b = load_file(synced["b"] / "model.safetensors")
    reported: dict[str, list[np.ndarray]] = {}
    for rank_changes in synced["learner"]["changes"]:
        for name, idx, old, new in rank_changes:
            assert (bits_view(a[name]).reshape(-1)[idx] == old).all(), name
            assert (bits_view(b[name]).reshape(-1)[idx] == new).all(), name
            reported.setdefault(name, []).append(idx)
    for name in a:
        want = np.flatnonzero(bits_view(a[name]).reshape(-1) != bits_view(b[name]).reshape(-1))
        got = np.sort(np.concatenate(reported.get(name, [np.zeros(0, np.int64)])))
        assert np.array_equal(got, want), f"{name}: changed elements not reported exactly once"
    experts = [name for name in reported if ".mlp.experts." in name]
    assert len(experts) == 2 * 4 * 3  # every expert's three projections in both layers


@pytest.mark.parametrize(("tp", "ep"), RECEIVERS)
def test_fused_experts_equal_sglangs_own_load_bit_for_bit(synced, tp, ep):
    for rank in range(tp):
        got = synced[tp, ep, rank]
        assert got["answers"] == [[True, "Success"], [True, "Success"]]  # one POST per learner rank
        assert got["version"] == 2 and got["learners"] == [0, 1]
        assert got["mismatched"] == [], got["mismatched"]
        assert sorted(got["changed"]) == got["params"]  # every parameter really moved, fused experts included
        assert "model.layers.0.mlp.experts.w13_weight" in got["params"]
        # 4 experts of width 32, hidden 64: EP splits the experts, EP=1 splits each expert over TP
        assert (got["w13"], got["w2"]) == ([4 // ep, 2 * 32 * ep // tp, 64], [4 // ep, 64, 32 * ep // tp])
        assert (got["moe_ep_rank"], got["moe_tp_rank"]) == ((rank, 0) if ep == 2 else (0, rank))


def test_sglang_moe_block_serves_the_synced_weights(synced):
    """At EP=1 only: SGLang's CPU MoE path cannot run EP > 1 (tests/sglang_moe_worker.py)."""
    from transformers import AutoModelForCausalLM

    forward = synced[2, 1, "forward"]
    model = AutoModelForCausalLM.from_pretrained(synced["b"], dtype=torch.float32).float().eval()
    with torch.no_grad():
        want = model.model.layers[0].mlp(forward["hidden"].float()[None])
    want = (want[0] if isinstance(want, tuple) else want)[0]
    err = (forward["output"] - want).abs().max() / want.abs().max()
    assert err < 2e-2, f"SGLang's MoE block (bf16) vs HF transformers (fp32): {err:.3g}"
