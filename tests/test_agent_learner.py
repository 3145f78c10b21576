"""A multi-turn episode is one training row with holes in its mask: with KV compression off in
fp32, megatron-core's recomputed log-probs over the whole row equal the engine's on every turn."""

from __future__ import annotations

import pytest
import torch
from agent_support import engine, runner, specs, tiny_checkpoint, tokenizer
from single_process import cpu_runtime

from sparserl_mcore.agent import Env, Reply, Turn
from sparserl_mcore.trainer.batch import build_batch


class ThreeTurns(Env):
    stop = (";",)

    def reset(self, row):
        return row["prompt"]

    def step(self, turn: Turn) -> Reply:  # a plain def works too
        if turn.index < 2:
            return Reply(observation=f"={turn.index} r1\n")
        return Reply(done=True, reward=float(len(turn.text) % 2))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    hf = tiny_checkpoint(tmp_path_factory.mktemp("agent_learner") / "hf")
    with cpu_runtime(seed=5) as rt:
        yield rt, hf


def _learner(rt, hf):
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.trainer.setup import build_learner

    cfg = config_from_dict(
        {
            "model": {"hf_path": str(hf), "params_dtype": "fp32"},
            "data": {"train_path": "unused.jsonl"},
            "train": {"prompts_per_step": 2, "global_batch_size": 4, "micro_batch_size": 4},
            "rollout": {"group_size": 2, "env": {"name": "lookup_chain"}},
            "reward": {},
            "loss": {"policy": {"kl_coef": 0.0}},
        }
    )
    return build_learner(cfg, rt)


def test_learner_recompute_equals_the_engine_on_every_turn(runtime):
    from sparserl_mcore.loss import megatron_step

    rt, hf = runtime
    tok = tokenizer(hf)
    run = runner({"e0": engine(hf)}, ThreeTurns, tok, max_turns=3, max_tokens_per_turn=7)
    episodes = run.run(specs([{"prompt": "hop 2 from 7\n"}, {"prompt": "hop 3 from 1\n"}], group_size=2))
    batch = build_batch(episodes, [e.reward for e in episodes], group_size=2, normalize_std=True)
    learner = _learner(rt, hf)
    logp = megatron_step.compute_logprobs(
        learner.model,
        batch.tokens_BT,
        micro_batch_size=4,
        temperature=1.0,
        vocab_size=learner.update_cfg.vocab_size,
        runtime=rt,
    ).cpu()
    for row, ep in enumerate(episodes):
        assert len(ep.turns) == 3 and ep.end_reason == "done"
        turn_of = torch.tensor(ep.turn_of)
        n = len(ep.tokens)
        assert torch.equal(batch.mask_BT[row, :n], (turn_of >= 0).float())
        for k in range(3):
            at = torch.nonzero(turn_of == k).flatten()
            assert len(at) == len(ep.turns[k].output_ids) > 0
            diff = (logp[row, at] - batch.logp_sparse_BT[row, at]).abs().max().item()
            assert diff < 1e-4, f"episode {row} turn {k}: max |diff| {diff:.2e}"
    # and the holes are holes: nothing but zeros where the mask is 0
    off = batch.mask_BT == 0
    assert not batch.logp_sparse_BT[off].any() and not batch.versions_BT[off].any()


def test_the_correction_is_reported_per_turn(runtime):
    """A compressed engine's episodes through train_on_batch: mismatch KL, veto and band rejections
    per turn index equal a hand computation over each turn's sampled tokens."""
    import dataclasses

    from sparserl_mcore.loss import megatron_step
    from sparserl_mcore.loss.correction import CorrectionConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

    rt, hf = runtime
    tok = tokenizer(hf)
    kv = KVCompressionConfig(method="streamingllm", budget=8, window=2, sink_tokens=2, interval=2)
    run = runner({"e0": engine(hf, kv_compression=kv)}, ThreeTurns, tok, max_turns=3, max_tokens_per_turn=7)
    episodes = run.run(specs([{"prompt": "hop 2 from 7\n"}, {"prompt": "hop 3 from 1\n"}], group_size=2))
    batch = build_batch(episodes, [e.reward for e in episodes], group_size=2, normalize_std=True)
    assert batch.turn_BT is not None
    for row, ep in enumerate(episodes):
        assert batch.turn_BT[row, : len(ep.tokens)].tolist() == list(ep.turn_of)
        assert not (batch.turn_BT[row, len(ep.tokens) :] + 1).any()
    learner = _learner(rt, hf)
    assert learner.update_cfg.max_turns == 4  # rollout.env's max_turns, set by setup.update_config
    # thresholds close to 1, so that on this tiny mismatch some turns veto and some tokens leave the band
    cc = CorrectionConfig(veto_threshold=0.9, reject_low=0.97, reject_high=1.03)
    cfg = dataclasses.replace(learner.update_cfg, correction=cc)
    logp_old = megatron_step.compute_logprobs(
        learner.model,
        batch.tokens_BT,
        micro_batch_size=4,
        temperature=1.0,
        vocab_size=cfg.vocab_size,
        runtime=rt,
        mask_BT=batch.mask_BT,
    ).cpu()
    update = megatron_step.UpdateBatch(
        tokens_BT=batch.tokens_BT,
        mask_BT=batch.mask_BT,
        advantages_B=batch.advantages_B,
        logp_sparse_BT=batch.logp_sparse_BT,
        lengths_B=batch.lengths_B,
        turn_BT=batch.turn_BT,
    )
    from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate

    result = megatron_step.train_on_batch(
        learner.model,
        learner.optimizer,
        update,
        cfg=cfg,
        gate=DynamicGradientGate(DGGConfig()),
        runtime=rt,
    )
    m = result.metrics
    log_xi = (logp_old - batch.logp_sparse_BT).double()
    xi = log_xi.exp()
    valid = batch.mask_BT.bool()
    vetoed_rows = (valid & (xi < cc.veto_threshold)).any(dim=1)
    vetoes = 0
    for k in range(3):
        kl, triggered, rejected, tokens = 0.0, 0, 0, 0
        for row in range(batch.size):
            at = valid[row] & (batch.turn_BT[row] == k)
            d = log_xi[row, at]
            kl += float((d.exp() - 1 - d).sum())
            triggered += int((xi[row, at] < cc.veto_threshold).any())
            if not vetoed_rows[row]:
                rejected += int(((xi[row, at] < cc.reject_low) | (xi[row, at] > cc.reject_high)).sum())
            tokens += int(at.sum())
        assert m[f"correction/mismatch_kl_turn{k}"] == pytest.approx(kl / tokens, rel=1e-4, abs=1e-7)
        assert m[f"correction/veto_frac_turn{k}"] == pytest.approx(triggered / batch.size)
        assert m[f"correction/rejected_token_frac_turn{k}"] == pytest.approx(rejected / tokens)
        vetoes += triggered
    rejections = sum(m[f"correction/rejected_token_frac_turn{k}"] for k in range(3))
    assert m["correction/mismatch_kl_turn2"] > 0 and vetoes > 0 and rejections > 0  # not all zero
    assert "correction/mismatch_kl_turn3" not in m  # no episode reached a fourth turn
    assert not any(k.startswith("turn/") for k in m)
