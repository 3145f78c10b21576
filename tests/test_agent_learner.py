"""A multi-turn episode is one training row with holes in its mask: with KV compression off in
fp32, megatron-core's recomputed log-probs over the whole row equal the engine's on every turn."""

from __future__ import annotations

import os

import pytest
import torch
from agent_support import engine, runner, specs, tiny_checkpoint, tokenizer

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
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    if torch.cuda.is_available():
        pytest.skip("single CPU process")
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS") if k in os.environ}
    hf = tiny_checkpoint(tmp_path_factory.mktemp("agent_learner") / "hf")
    rt = initialize(ParallelConfig(), seed=5)
    yield rt, hf
    shutdown()
    os.environ.update(saved)


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
