"""MoE router losses count real tokens only (megatron's padding mask from the one forward entry).

A sequence right-padded, with its length given, yields the aux loss, z-loss and tokens per expert
of the same sequence unpadded, on one process and at TP=2 with sequence parallelism (megatron
splits the mask over TP) and TP=2 x PP=2 (later stages take their own chunk of the mask).
Without the mask the padding is routed and counted: the figures differ, so the test can fail.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

WORKER = str(pathlib.Path(__file__).with_name("moe_padding_worker.py"))
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(
        make_tiny(TinyModelConfig(arch="qwen3_moe", vocab=100, seed=5), tmp_path_factory.mktemp("moe") / "m")
    )


def _run(out: pathlib.Path, hf: str, tp: int, pp: int) -> list[dict]:
    args = [WORKER, str(out), hf, "--tp", str(tp), "--pp", str(pp)]
    if tp * pp == 1:
        env = {**os.environ, **CPU_ONLY, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    else:
        launch_local(args, tp * pp, env=CPU_ONLY, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp * pp)]


def _per_stage(ranks: list[dict], case: str) -> dict[int, tuple[torch.Tensor, float]]:
    """pp stage -> (tokens per expert per layer, aux loss), summed over the stage's TP ranks
    (under sequence parallelism each holds a chunk of the sequence and its part of the loss)."""
    out: dict[int, tuple[torch.Tensor, float]] = {}
    for r in ranks:
        counts, aux = out.get(r["pp_rank"], (0, 0.0))
        out[r["pp_rank"]] = (counts + r[case]["tokens_per_expert"], aux + r[case]["aux_loss"])
    return out


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_padded_batch_has_the_unpadded_router_losses(tmp_path, hf_dir, tp, pp):
    ranks = _run(tmp_path, hf_dir, tp, pp)
    alone, masked, unmasked = (_per_stage(ranks, case) for case in ("alone", "masked", "unmasked"))
    for stage, (counts, aux) in alone.items():
        assert torch.equal(masked[stage][0], counts)
        assert masked[stage][1] == pytest.approx(aux, rel=1e-6)
        # without the mask the padding is routed and counted: the test can fail
        assert unmasked[stage][0].sum() > counts.sum()
        assert unmasked[stage][1] != pytest.approx(aux, rel=1e-6)
    if tp == 1:  # the z-loss is a mean over a rank's own tokens: comparable when a rank has them all
        for r in ranks:
            torch.testing.assert_close(r["masked"]["z_loss"], r["alone"]["z_loss"], rtol=1e-6, atol=0)
            assert not torch.allclose(r["unmasked"]["z_loss"], r["alone"]["z_loss"], rtol=1e-6, atol=0)
