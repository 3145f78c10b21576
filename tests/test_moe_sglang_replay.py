"""Rollout routing replay (R3) through a LIVE SGLang 0.5.23 server on CPU: `sparserl sglang-serve
--device cpu --return-routed-experts` (tests/sglang_live.py) serves a tiny Qwen3-MoE with SGLang's
own `Qwen3MoeForCausalLM` (its CPU MoE path) and returns the experts it routed each token to
(`meta_info["routed_experts"]`); the trainer's SGLang client (`setup.build_engines`) reads them
in the model's shape, `routing_replay.attach` lays them beside the tokens, and the real megatron
learner (tests/moe_replay_worker.py, TP=1) replays them in the pi_old recompute and in the
training pass of a GRPO update. One server for the module (start-up costs a minute or two on a
2-core box).

What each test shows:
- the learner's top-k equals SGLang's on every replayed token, also after a noise on its routers
  that makes it route some tokens differently without replay; SGLang returns the ids of a
  radix-cached prompt prefix too, so every fed token is replayed; unperturbed, the learner's own
  routing (fp32) agrees with SGLang's (bf16) on nearly every choice, so the ids are laid out by
  (token, layer) as the learner reads them;
- a payload whose shape does not fit the sample is refused and counted, not trained on.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from sglang_live import post, start
from test_moe_replay import _by_position, _run

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.config import config_from_dict
from sparserl_mcore.rollout.protocol import SamplingParams
from sparserl_mcore.sglang import wire
from sparserl_mcore.sglang.client import returns_routed_experts
from sparserl_mcore.trainer.batch import build_batch
from sparserl_mcore.trainer.rollouts import Prompt, make_requests
from sparserl_mcore.trainer.routing_replay import RoutingShape, attach
from sparserl_mcore.trainer.setup import build_engines

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None or importlib.util.find_spec("uvloop") is None,
    reason="a live SGLang server needs `make setup` (sglang 0.5.23 and its HTTP server's packages)",
)

VOCAB = 130
SHAPE = RoutingShape(layers=2, top_k=2, experts=8)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The checkpoint and the URL of one SGLang server started with routed experts on."""
    root = tmp_path_factory.mktemp("sglang-replay")
    tiny = TinyModelConfig(arch="qwen3_moe", vocab=VOCAB, experts=8, seed=5, dtype="bfloat16")
    hf = make_tiny(tiny, root / "m")
    server = start(hf, root / "sglang.log", {"method": "none"}, serve_args=("--return-routed-experts",))
    try:
        server.wait_ready()
        # the trainer reads samples of versions it synced: label the served weights version 0
        post(server.url, "/update_weights_from_disk", {"model_path": str(hf), "weight_version": "0"})
        yield hf, server.url
    finally:
        server.stop()


def _engine(hf, url: str):
    cfg = config_from_dict(
        {"model": {"hf_path": str(hf), "moe": {"routing_replay": True}}, "data": {"train_path": "t.jsonl"}},
        ["rollout.engine=remote", f"rollout.urls=[{url}]", "rollout.server=sglang"],
    )
    (engine,) = build_engines(cfg, compressed=True, device="cpu").values()
    return engine


def _requests(tag: str, lengths, group_size: int = 2):
    g = torch.Generator().manual_seed(4)
    prompts = [Prompt(tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()), "") for n in lengths]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True)
    return make_requests(
        prompts, tag=tag, group_size=group_size, sampling=sampling, run_seed=1, return_routed_experts=True
    )


def test_learner_replays_sglangs_routing(tmp_path, live):
    hf, url = live
    assert returns_routed_experts(url) is True  # what preflight asks of a worker under replay
    engine = _engine(hf, url)
    requests = _requests("t", (9, 6))
    samples = [s for r in requests for s in engine.generate([r])]  # one by one: later ones hit the cache
    engine.close()
    assert sum(s.cached_prompt_tokens for s in samples) > 0  # the radix cache served prompt prefixes
    assert [s.routed_experts_start for s in samples] == [0] * 4  # ... and SGLang still returned them
    assert RoutingShape.of_checkpoint(hf) == SHAPE
    batch = build_batch(samples, [0.0, 1.0, 1.0, 0.0], group_size=2, normalize_std=False)
    batch, metrics, refused = attach(batch, samples, SHAPE)
    fed = int((batch.lengths_B - 1).sum())
    assert refused == [] and metrics["moe/replayed_tokens"] == fed and metrics["moe/unreplayed_tokens"] == 0
    path = tmp_path / "batch.pt"
    torch.save({f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, path)

    (rank,) = _run(tmp_path / "out", str(hf), path, 1, 1, 1, 1)
    routed = batch.routed_BTLK.long().sort(dim=-1).values  # [b, t, L, k]
    b, t = batch.tokens_BT.shape
    given = routed[..., 0, 0] >= 0
    flips = agree = 0
    for layer in range(SHAPE.layers):
        served = routed[:, :, layer][given]
        runs = ("free", "perturbed", "replayed", "trained")
        free, perturbed, replayed, trained = (_by_position([rank], run, layer, b, t)[given] for run in runs)
        assert torch.equal(replayed, served)  # pi_old recompute
        assert torch.equal(trained, served)  # the GRPO update's training pass
        flips += int((perturbed != served).any(dim=-1).sum())
        agree += int((free == served).all(dim=-1).sum())
    assert flips > 0, "the noise on the routers changed no choice: the test could not fail"
    # bf16 SGLang vs the fp32 learner on the same weights: near-ties may swap (measured: 3 of 108
    # choices); ids laid out by the wrong token or layer would agree by chance only
    assert agree >= 0.9 * SHAPE.layers * int(given.sum()), (agree, int(given.sum()))
    assert all(moved > 0 for moved in rank["router_moved"].values())  # the routers still train


def test_a_live_payload_that_does_not_fit_is_refused(live):
    """SGLang's answer read in another model's shape: the ids are dropped (one logged line) and
    the sample is refused, counted and masked out; the same answer read right is kept."""
    hf, url = live
    engine = _engine(hf, url)
    (request,) = _requests("w", (5,), group_size=1)
    body = wire.generate_body([request])
    (answer,) = engine._call("POST", "/generate", json=body).json()
    engine.close()
    right = wire.read_sample(answer, request, (SHAPE.layers, SHAPE.top_k))
    wrong = wire.read_sample(answer, request, (SHAPE.layers + 1, SHAPE.top_k))
    assert right.routed_experts is not None and right.routed_experts.shape == (5 + 7 - 1, 2, 2)
    assert wrong.routed_experts is None
    samples = [right, dataclasses.replace(wrong, rid="wrong")]
    batch = build_batch(samples, [1.0, 0.0], group_size=2, normalize_std=False)
    batch, metrics, refused = attach(batch, samples, SHAPE)
    assert refused == ["sample wrong: no routed experts returned; not trained on"]
    assert metrics["moe/replay_refused_samples"] == 1 and batch.mask_BT[1].sum() == 0
    assert batch.mask_BT[0].sum() > 0 and metrics["moe/replayed_tokens"] == 5 + 7 - 1
