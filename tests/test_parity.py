"""Megatron (model_providers + parallel runtime) vs HF transformers logits, fp32, real megatron-core
over gloo: qwen2, qwen3 (head_dim != hidden/heads), llama (llama3 RoPE scaling), tied and untied,
and a 5-layer llama whose PP=2 stages are uneven (3, 2), at (TP, PP) = (1, 1), (2, 1), (1, 2).
One 2-rank torchrun run covers every layout and checkpoint (PP=3: tests/test_uneven_pipeline.py).
`sparserl convert verify` runs end to end on a converted checkpoint, matching and mismatching.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("parity_worker.py"))
# vocab 200 pads to 256 at TP 1 and 2; 4 heads / 2 KV heads (GQA); qwen3 head_dim 24 != 64 / 4.
CHECKPOINTS = {
    f"{arch}{'_tied' if tied else ''}": TinyModelConfig(
        arch=arch, tie_embeddings=tied, vocab=200, head_dim=24 if arch == "qwen3" else None, seed=len(arch)
    )
    for arch in ("qwen2", "qwen3", "llama")
    for tied in (False, True)
} | {"llama_5layers": TinyModelConfig(arch="llama", layers=5, vocab=200, seed=5)}
TOLERANCE = 1e-5
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # gloo + the CPU execution mode even on GPU machines


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("parity")
    return {name: make_tiny(cfg, root / name) for name, cfg in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def parity_results(hf_dirs, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("parity_results")
    argv = [WORKER, str(out), "1x1,2x1,1x2,2x1:bfloat16", *map(str, hf_dirs.values())]
    launch_local(argv, 2, env=CPU_ONLY, timeout=600)
    merged: dict[str, dict] = {}
    for rank_file in sorted(out.glob("rank*.json")):
        merged.update(json.loads(rank_file.read_text()))
    return merged


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_logits_match_hf_transformers(parity_results, tp, pp):
    results = parity_results[f"{tp},{pp}"]
    assert sorted(results["parity"]) == sorted(CHECKPOINTS)
    for name, found in results["parity"].items():
        assert found["shape"] == [4, 16, 200], name
        assert found["padded_vocab"] == 256, name
        assert found["max_rel"] < TOLERANCE, f"{name} at TP={tp} PP={pp}: {found}"

    draws = results["rng"]
    if tp == 2:  # TP ranks: distinct model-parallel streams, one shared default stream
        assert draws[0]["model_parallel"] != draws[1]["model_parallel"]
        assert draws[0]["default"] == draws[1]["default"]
    if pp == 2:  # pipeline stages are seeded apart (seed + 100 * pp_rank), as in megatron
        assert draws[0]["default"] != draws[1]["default"]
    if (tp, pp) == (1, 1):  # data-parallel replicas share every stream
        assert draws[0] == draws[1]


def bf16_within_tolerance(found: dict) -> bool:
    """Megatron in bf16 is as close to the fp32 reference as HF transformers in bf16 is (within 2x,
    or 1 % of the largest logit, whichever is larger): bf16 rounding, not a layout or cast bug."""
    return found["max_rel"] <= max(2 * found["hf_max_rel"], 1e-2)


def test_bf16_logits_match_hf_transformers(parity_results):
    results = parity_results["2,1,bfloat16"]["parity"]
    assert sorted(results) == sorted(CHECKPOINTS)
    for name, found in results.items():
        assert found["max_rel"] > 0, name  # really bf16: an fp32 model would match to ~1e-7
        assert bf16_within_tolerance(found), f"{name} in bf16: {found}"


@pytest.mark.gpu
def test_logits_match_hf_transformers_on_gpu(hf_dirs, tmp_path):
    """Every registered architecture on one GPU (NCCL): fp32 to 1e-5, bf16 at bf16 tolerance."""
    launch_local([WORKER, str(tmp_path), "1x1,1x1:bfloat16", *map(str, hf_dirs.values())], 1, timeout=600)
    reported = json.loads((tmp_path / "rank0.json").read_text())
    for key in ("1,1", "1,1,bfloat16"):
        results = reported[key]["parity"]
        assert sorted(results) == sorted(CHECKPOINTS)
        for name, found in results.items():
            assert "cuda:nccl" in found["backend"] and found["device"].startswith("cuda"), (name, found)
            ok = found["max_rel"] < TOLERANCE if key == "1,1" else bf16_within_tolerance(found)
            assert ok, f"{name} on GPU ({key}): {found}"


def _sparserl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sparserl_mcore", *args]
    env = {**os.environ, **CPU_ONLY}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)


def test_convert_verify_cli(hf_dirs, tmp_path):
    import dataclasses

    other = dataclasses.replace(CHECKPOINTS["qwen3_tied"], seed=99)  # same model, other weights
    hf, other_hf, mcore = (
        str(hf_dirs["qwen3_tied"]),
        str(make_tiny(other, tmp_path / "other")),
        str(tmp_path / "mcore"),
    )
    converted = _sparserl("convert", "hf-to-mcore", "--hf-dir", hf, "--out", mcore)
    assert converted.returncode == 0, converted.stdout + converted.stderr

    ok = _sparserl("convert", "verify", "--hf-dir", hf, "--mcore-dir", mcore, "--tp", "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    last = ok.stdout.strip().splitlines()[-1]
    assert last.startswith("max_abs_diff=") and last.endswith("OK"), ok.stdout
    assert float(last.split("max_rel_diff=")[1].split()[0]) < TOLERANCE

    # Same model, other weights: a real mismatch, exit 1, and nothing that reads "verified".
    bad = _sparserl("convert", "verify", "--hf-dir", other_hf, "--mcore-dir", mcore)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    lines = bad.stdout.strip().splitlines()
    assert lines[-1].endswith("FAIL") and lines[0].startswith("MISMATCH") and "verified" not in bad.stdout

    # A layout the model cannot take, or another architecture: refused before any rank, exit 2.
    for argv in (("--hf-dir", hf, "--tp", "3"), ("--hf-dir", str(hf_dirs["qwen3"]))):
        refused = _sparserl("convert", "verify", *argv, "--mcore-dir", mcore)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout, refused.stderr
    assert (
        "does not divide num_attention_heads=4"
        in _sparserl("convert", "verify", "--hf-dir", hf, "--tp", "3", "--mcore-dir", mcore).stderr
    )
