"""pass@1 on the held-out split under compressed KV (the rollout engines) and dense KV; with
rollout.env, the mean episode reward of one greedy episode per prompt.

Collective over the learner group: the host rank generates and scores, the numbers are broadcast
to every learner rank. A prompt whose reward is non-finite (kept as NaN only under
reward.skip_nonfinite) is left out of the mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from sparserl_mcore.agent.runner import EpisodeRunner
from sparserl_mcore.rollout.protocol import SamplingParams
from sparserl_mcore.trainer.engine_pool import EnginePool, Fleet
from sparserl_mcore.trainer.rollout_manager import RolloutManager
from sparserl_mcore.trainer.rollouts import HOST_RANK, Prompt, RewardFn, episode_specs, make_requests


class Evaluator:
    def __init__(
        self,
        cfg: Any,
        prompts: list[Prompt],
        reward_fn: RewardFn,
        rollout: Any,
        *,
        seed: int,
        group: dist.ProcessGroup,
        episodes: Callable[[EnginePool, SamplingParams], EpisodeRunner] | None = None,
    ):
        self.cfg, self.prompts, self.reward_fn, self.seed = cfg, prompts, reward_fn, seed
        self.group = group  # the learner ranks (`Runtime.learner_group`); the host rank is one of them
        self.sampling: SamplingParams = dataclasses.replace(rollout.sampling, temperature=cfg.temperature)
        self.episodes = episodes

    def _pass_at_1(self, pool: Fleet) -> float:
        if self.episodes is not None:
            assert isinstance(pool, EnginePool), "rollout.env runs in the learner's process (manager: thread)"
            specs = episode_specs(self.prompts, tag="eval", group_size=1)
            return sum(e.reward for e in self.episodes(pool, self.sampling).run(specs)) / len(specs)
        requests = make_requests(
            self.prompts, tag="eval", group_size=1, sampling=self.sampling, run_seed=self.seed
        )
        if isinstance(pool, RolloutManager):  # generated and scored in its process
            _, scores = pool.score_requests(requests, self.prompts)
        else:
            samples = pool.generate(requests)
            scores = [self.reward_fn(s, p) for s, p in zip(samples, self.prompts, strict=True)]
        scored = [x for x in scores if not math.isnan(x)]  # NaN: non-finite, skipped (reward.skip_nonfinite)
        return sum(scored) / len(scored) if scored else math.nan

    def run(self, compressed: Fleet | None, dense: Fleet | None) -> dict[str, float]:
        out: list[Any] = [{}]
        if dist.get_rank() == HOST_RANK and self.prompts:
            if self.cfg.compressed:
                assert compressed is not None, "the host rank holds the compressed engine pool"
                out[0]["eval/pass1_compressed"] = self._pass_at_1(compressed)
            if self.cfg.dense and dense is not None:
                out[0]["eval/pass1_dense"] = self._pass_at_1(dense)
        dist.broadcast_object_list(out, src=HOST_RANK, group=self.group)
        return out[0]
