"""Rollout routing replay (R3) end to end on CPU: the embedded engine returns the experts it routed
(HF's routing: tests/test_moe_engine.py), the trainer lays them beside the tokens
(`trainer.routing_replay.attach`), and the real megatron learner replays them in the pi_old
recompute and in the training pass of a GRPO update, at TP=1, TP=2 x EP=2 (sequence parallel:
each TP rank routes its own chunk of the sequence) and TP=2 x PP=2 (the second stage's routers
hold global layer 1) over gloo.

The learner's routing is read back per router (`MergingReplay.recorded`, megatron's [s, b] token
order) and laid out by position here, independently of the replay code: unperturbed, the learner
routes every token as the engine did (so the layout is right); with a small noise on its routers
it routes some differently without replay, and exactly as the engine on every replayed token with
it. Prompt prefixes the engine served from its prefix cache are not replayed (counted).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.protocol import SamplingParams
from sparserl_mcore.trainer.batch import build_batch
from sparserl_mcore.trainer.rollouts import Prompt, make_requests
from sparserl_mcore.trainer.routing_replay import RoutingShape, attach

WORKER = str(pathlib.Path(__file__).with_name("moe_replay_worker.py"))
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
VOCAB = 100


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> tuple[str, pathlib.Path, dict]:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 layers), 2 prompts x 2 samples from the embedded engine
    (the second of a group hits the prefix cache), laid out as the trainer's batch."""
    root = tmp_path_factory.mktemp("replay")
    hf = str(make_tiny(TinyModelConfig(arch="qwen3_moe", vocab=VOCAB, experts=8, seed=5), root / "m"))
    engine = EmbeddedEngine(hf, EngineConfig(device="cpu", page_size=4, capacity_pages=64))
    g = torch.Generator().manual_seed(4)
    prompts = [Prompt(tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()), "") for n in (9, 6)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True)
    requests = make_requests(
        prompts, tag="t", group_size=2, sampling=sampling, run_seed=1, return_routed_experts=True
    )
    samples = [engine.generate([r])[0] for r in requests]  # one by one: later ones hit the cache
    assert [s.routed_experts_start for s in samples] == [0, 8, 0, 4]
    batch = build_batch(samples, [0.0, 1.0, 1.0, 0.0], group_size=2, normalize_std=False)
    shape = RoutingShape.of_checkpoint(hf)
    assert shape == RoutingShape(layers=2, top_k=2, experts=8)
    batch, metrics, refused = attach(batch, samples, shape)
    fed = int((batch.lengths_B - 1).sum())
    assert refused == [] and metrics["moe/replayed_tokens"] == fed - 8 - 4
    assert metrics["moe/unreplayed_tokens"] == 12
    data = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    path = root / "batch.pt"
    torch.save(data, path)
    return hf, path, data


def _run(
    out: pathlib.Path, hf: str, batch: pathlib.Path, tp: int, ep: int, pp: int, world: int
) -> list[dict]:
    args = [WORKER, str(out), hf, str(batch), "--tp", str(tp), "--ep", str(ep), "--pp", str(pp)]
    if world == 1:
        env = {**os.environ, **CPU_ONLY, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    else:
        launch_local(args, world, env=CPU_ONLY, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _by_position(ranks: list[dict], run: str, layer: int, b: int, t: int) -> torch.Tensor:
    """[b, t, k] sorted ids: the TP ranks' [s_local * b, k] chunks (sequence-major) joined, from
    the ranks of the pipeline stage that holds `layer`."""
    ranks = [r for r in ranks if layer in r["runs"][run]]
    tp = max(r["tp_rank"] for r in ranks) + 1
    chunks = [next(r for r in ranks if r["tp_rank"] == i)["runs"][run][layer] for i in range(tp)]
    ids = torch.cat([c.view(-1, b, c.shape[-1]) for c in chunks])  # [s_padded, b, k]
    return ids.transpose(0, 1)[:, :t].sort(dim=-1).values


@pytest.mark.parametrize(("tp", "ep", "pp", "world"), [(1, 1, 1, 1), (2, 2, 1, 4), (2, 1, 2, 4)])
def test_learner_replays_the_engines_routing(tmp_path, rollout, tp, ep, pp, world):
    hf, path, data = rollout
    routed = data["routed_BTLK"].long().sort(dim=-1).values  # [b, t, L, k]
    b, t = data["tokens_BT"].shape
    given = routed[..., 0, 0] >= 0
    ranks = _run(tmp_path, hf, path, tp, ep, pp, world)
    assert sorted({layer for r in ranks for layer in r["runs"]["trained"]}) == [0, 1]
    flips = 0
    for layer in range(2):
        engine = routed[:, :, layer]
        free, perturbed, replayed, trained = (
            _by_position(ranks, run, layer, b, t) for run in ("free", "perturbed", "replayed", "trained")
        )
        assert torch.equal(free[given], engine[given])  # same weights: the engine's (HF's) routing
        flips += int((perturbed[given] != engine[given]).any(dim=-1).sum())
        assert torch.equal(replayed[given], engine[given])
        assert torch.equal(trained[given], engine[given])
        stage = [r for r in ranks if layer in r["runs"]["trained"]]
        for r in stage:  # every rank's chunk matches (EP ranks and dense DP copies route alike)
            same_tp = next(q for q in stage if q["tp_rank"] == r["tp_rank"])
            assert torch.equal(r["runs"]["trained"][layer], same_tp["runs"]["trained"][layer])
    assert flips > 0, "the noise on the routers changed no choice: the test could not fail"
    assert all(moved > 0 for r in ranks for moved in r["router_moved"].values())


def test_a_payload_that_does_not_fit_is_refused(rollout):
    """A sample whose ids miss a row (or name an expert the model lacks) is not trained on."""
    hf, _, data = rollout
    from sparserl_mcore.rollout.protocol import Sample

    shape = RoutingShape.of_checkpoint(hf)
    assert shape is not None
    base = Sample(
        rid="x", prompt_ids=(1, 2, 3), output_ids=(4, 5), output_logprobs=(0.0, 0.0), finish_reason="length"
    )
    good = dataclasses.replace(base, routed_experts=torch.zeros(4, 2, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="routed_experts has 3 rows from position 0"):
        dataclasses.replace(base, routed_experts=torch.zeros(3, 2, 2, dtype=torch.int16))
    wild = dataclasses.replace(good, rid="wild", routed_experts=torch.full((4, 2, 2), 9, dtype=torch.int16))
    layers = dataclasses.replace(good, rid="layers", routed_experts=torch.zeros(4, 3, 2, dtype=torch.int16))
    missing = dataclasses.replace(base, rid="missing")  # e.g. a payload the client dropped (wire.py)
    samples = [good, wild, layers, missing]
    batch = build_batch(samples, [0.0, 1.0, 0.0, 1.0], group_size=2, normalize_std=False)
    batch, metrics, refused = attach(batch, samples, shape)
    assert refused == [
        "sample wild: expert ids 9..9 outside [0, 8); not trained on",
        "sample layers: routed experts (4, 3, 2), expected (4, 2, 2); not trained on",
        "sample missing: no routed experts returned; not trained on",
    ]
    assert metrics["moe/replay_refused_samples"] == 3 and batch.mask_BT[1:].sum() == 0
    assert metrics["moe/replayed_tokens"] == 4 and batch.routed_BTLK[1:].eq(-1).all()
    assert batch.mask_BT[0].sum() == 2 and torch.equal(
        batch.routed_BTLK[0, :4].long(), torch.zeros(4, 2, 2).long()
    )


def test_remote_engines_carry_routing_into_the_batch(rollout):
    """`rollout.engine=remote` with replay: the trainer's clients (`setup.build_engines`) read the
    routed experts `sparserl serve` returns in the model's shape, and the batch replays them."""
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
    from sparserl_mcore.trainer.setup import build_engines

    hf, _, _ = rollout
    served = EmbeddedEngine(hf, EngineConfig(device="cpu", page_size=4, capacity_pages=64))
    with BackgroundServer(create_app(served, ServerConfig())) as server:
        cfg = config_from_dict(
            {"model": {"hf_path": hf, "moe": {"routing_replay": True}}, "data": {"train_path": "t.jsonl"}},
            ["rollout.engine=remote", f"rollout.urls=[{server.url}]"],
        )
        (engine,) = build_engines(cfg, compressed=True, device="cpu").values()
        prompts = [Prompt((5, 6, 7, 8, 9), "")]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
        requests = make_requests(
            prompts, tag="r", group_size=2, sampling=sampling, run_seed=3, return_routed_experts=True
        )
        samples = engine.generate(requests)
        engine.close()
    shape = RoutingShape.of_checkpoint(hf)
    assert shape is not None
    batch = build_batch(samples, [0.0, 1.0], group_size=2, normalize_std=False)
    batch, metrics, refused = attach(batch, samples, shape)
    cached = sum(s.routed_experts_start for s in samples)  # prompt pages the prefix cache served
    assert [s.routed_experts_start for s in samples] == [s.cached_prompt_tokens for s in samples]
    assert refused == [] and metrics["moe/replayed_tokens"] == 2 * (5 + 4 - 1) - cached
    assert metrics["moe/unreplayed_tokens"] == cached
    assert batch.routed_BTLK is not None and batch.routed_BTLK.dtype == torch.int8
