"""Turn a step's prompts into scored samples on the rank that talks to the engines.

Where the engines live: all rollout traffic goes through ONE rank, global rank 0 (the "host").
With `rollout.engine=embedded` the `EmbeddedEngine` is built in rank 0's process only (other
learner ranks never load it: it is an HF-layout model that needs no learner sharding); with
`rollout.engine=remote` rank 0 holds the `RemoteEngine` clients. Rank 0 generates, scores with
the reward function and broadcasts (samples, rewards) to every other learner rank with one
`torch.distributed.broadcast_object_list`, so all ranks build the identical training batch.

Request ids and seeds are functions of (run seed, step, prompt, sample), so a resumed run asks the
engines for exactly the draws the uninterrupted run made.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from sparserl_mcore.agent.runner import EpisodeRunner, EpisodeSpec
from sparserl_mcore.agent.trajectory import Episode
from sparserl_mcore.rollout.protocol import GenerateRequest, Sample, SamplingParams
from sparserl_mcore.trainer.engine_pool import Fleet

HOST_RANK = 0


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset, tokenized, with the reference answer its reward checks; `text`
    (the prompt before tokenizing) is what an environment's `reset` reads (rollout.env)."""

    input_ids: tuple[int, ...]
    answer: str
    text: str = ""


def request_seed(run_seed: int, tag: str) -> int:
    """A stable 63-bit seed per request: independent of batching, engine and process."""
    digest = hashlib.blake2b(f"{run_seed}:{tag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_requests(
    prompts: Sequence[Prompt],
    *,
    tag: str,
    group_size: int,
    sampling: SamplingParams,
    run_seed: int,
    return_routed_experts: bool = False,
) -> list[GenerateRequest]:
    """G requests per prompt (consecutive), each with its own id and seed (and, for rollout routing
    replay, asking for the experts the engine routed)."""
    requests = []
    for p, prompt in enumerate(prompts):
        for g in range(group_size):
            rid = f"{tag}-p{p}-g{g}"
            params = dataclasses.replace(sampling, seed=request_seed(run_seed, rid))
            requests.append(
                GenerateRequest(
                    input_ids=prompt.input_ids,
                    sampling=params,
                    rid=rid,
                    return_routed_experts=return_routed_experts,
                )
            )
    return requests


RewardFn = Callable[[Sample, Prompt], float]


def score_on_host(
    pool: Fleet | None,
    prompts: Sequence[Prompt],
    *,
    tag: str,
    group_size: int,
    sampling: SamplingParams,
    run_seed: int,
    reward_fn: RewardFn,
    return_routed_experts: bool = False,
) -> tuple[list[Sample], list[float]]:
    """Host rank only: G samples per prompt from the engines, each scored by the reward function."""
    assert pool is not None, "the host rank holds the engine pool"
    requests = make_requests(
        prompts,
        tag=tag,
        group_size=group_size,
        sampling=sampling,
        run_seed=run_seed,
        return_routed_experts=return_routed_experts,
    )
    samples = pool.generate(requests)
    rewards = [reward_fn(s, prompts[i // group_size]) for i, s in enumerate(samples)]
    return samples, rewards


def episode_specs(prompts: Sequence[Prompt], *, tag: str, group_size: int) -> list[EpisodeSpec]:
    """G episodes per prompt (consecutive), ids as `make_requests`' (turn k adds "-t<k>"); the
    environment's row holds the dataset's prompt and answer."""
    return [
        EpisodeSpec(
            rid=f"{tag}-p{p}-g{g}", row={"prompt": prompt.text, "answer": prompt.answer}, group=f"{tag}-p{p}"
        )
        for p, prompt in enumerate(prompts)
        for g in range(group_size)
    ]


def run_episodes_on_host(
    runner: EpisodeRunner | None, prompts: Sequence[Prompt], *, tag: str, group_size: int
) -> tuple[list[Episode], list[float]]:
    """Host rank only (rollout.env): G episodes per prompt, each with its summed Reply rewards."""
    assert runner is not None, "the host rank holds the episode runner"
    episodes = runner.run(episode_specs(prompts, tag=tag, group_size=group_size))
    return episodes, [e.reward for e in episodes]


def share_from_host(payload: Any, group: dist.ProcessGroup) -> Any:
    """Collective over `group` (the learner ranks, host included): the host's payload to every rank.

    A payload that is an exception (an engine failure on the host, e.g. `NoEngineLeftError`) is
    raised on every rank, so none waits forever for samples that will not come.
    """
    box: list[Any] = [payload if dist.get_rank() == HOST_RANK else None]
    dist.broadcast_object_list(box, src=HOST_RANK, group=group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def generate_and_score(
    pool: Fleet | None,
    prompts: Sequence[Prompt],
    *,
    tag: str,
    group_size: int,
    sampling: SamplingParams,
    run_seed: int,
    reward_fn: RewardFn,
    group: dist.ProcessGroup,
) -> tuple[list[Sample], list[float]]:
    """Collective over `group`: the host generates and scores (`score_on_host`), everyone receives
    the result (`share_from_host`)."""
    payload: Any = None
    if dist.get_rank() == HOST_RANK:
        try:
            payload = score_on_host(
                pool,
                prompts,
                tag=tag,
                group_size=group_size,
                sampling=sampling,
                run_seed=run_seed,
                reward_fn=reward_fn,
            )
        except Exception as exc:
            payload = exc
    return share_from_host(payload, group)
