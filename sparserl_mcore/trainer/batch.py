"""Rollout samples + rewards -> the padded tensors the learner trains on.

Shapes (legend): B sequences, T = longest prompt + response in the batch.
    tokens_BT        prompt then response token ids, right-padded with 0
    mask_BT          1.0 where tokens_BT[:, t] is a response token (the loss positions)
    logp_sparse_BT   the sampler's log-prob of tokens_BT[:, t] (0 outside mask_BT)
    advantages_B     GRPO advantage of each sequence
    versions_BT      the weight version that sampled tokens_BT[:, t] (0 outside mask_BT)
    lengths_B        real tokens of each row (prompt + response); the rest is padding
    routed_BTLK      rollout routing replay only: the engine's expert ids of tokens_BT[:, t] per
                     layer, -1 where it routed none (`trainer.routing_replay.attach`)
    turn_BT          multi-turn episodes only: the turn that sampled tokens_BT[:, t], -1 elsewhere
                     (the per-turn correction metrics)
Per-token arrays are indexed by the position of the token they score, the convention of
`sparserl_mcore.loss` (the log-prob of token t comes from the logits at position t - 1).
A multi-turn episode (`sparserl_mcore.agent.Episode`) is one row whose mask has holes: 1 on the
tokens the engine sampled, 0 on the prompt and on environment tokens between turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from sparserl_mcore.agent.trajectory import Episode
from sparserl_mcore.loss.advantages import grpo_advantages
from sparserl_mcore.rollout.protocol import Sample


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor
    logp_sparse_BT: torch.Tensor
    advantages_B: torch.Tensor
    rewards_B: torch.Tensor
    versions_BT: torch.Tensor
    lengths_B: torch.Tensor
    routed_BTLK: torch.Tensor | None = None
    turn_BT: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens_BT.shape[0]

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        """The sub-batch of the given rows (micro-batches, filtered groups)."""
        picked: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            picked[f.name] = None if value is None else value[rows]
        return RolloutBatch(**picked)


def informative_rows(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of groups whose rewards differ: a zero-variance group has advantage 0 everywhere
    and only dilutes the batch (DAPO's dynamic sampling filter)."""
    grouped = rewards_B.view(-1, group_size)
    keep_groups = (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0
    return torch.nonzero(keep_groups.repeat_interleave(group_size)).flatten()


def build_batch(
    samples: Sequence[Sample | Episode], rewards: Sequence[float], *, group_size: int, normalize_std: bool
) -> RolloutBatch:
    """Pad samples or episodes (a group's G consecutive) into one batch with GRPO advantages."""
    if len(samples) != len(rewards):
        raise ValueError(f"{len(samples)} samples but {len(rewards)} rewards")
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    B, T = len(samples), max(lengths)
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    mask_BT = torch.zeros(B, T, dtype=torch.float32)
    logp_sparse_BT = torch.zeros(B, T, dtype=torch.float32)
    versions_BT = torch.zeros(B, T, dtype=torch.long)
    episodes = all(isinstance(s, Episode) for s in samples)
    turn_BT = torch.full((B, T), -1, dtype=torch.long) if episodes else None
    for row, sample in enumerate(samples):
        if isinstance(sample, Episode):
            n = len(sample.tokens)
            tokens_BT[row, :n] = torch.tensor(sample.tokens)
            mask_BT[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            logp_sparse_BT[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
            versions_BT[row, :n] = torch.tensor(sample.versions, dtype=torch.long)
            if turn_BT is not None:
                turn_BT[row, :n] = torch.tensor(sample.turn_of, dtype=torch.long)
            continue
        p, n = len(sample.prompt_ids), len(sample.output_ids)
        if len(sample.output_logprobs) != n:
            raise ValueError(
                f"sample {sample.rid}: {len(sample.output_logprobs)} log-probs for {n} output tokens"
            )
        tokens_BT[row, : p + n] = torch.tensor(sample.prompt_ids + sample.output_ids)
        mask_BT[row, p : p + n] = 1.0
        logp_sparse_BT[row, p : p + n] = torch.tensor(sample.output_logprobs, dtype=torch.float32)
        versions_BT[row, p : p + n] = torch.tensor(sample.token_versions(), dtype=torch.long)
    rewards_B = torch.tensor(list(rewards), dtype=torch.float32)
    advantages_B = grpo_advantages(rewards_B, group_size, normalize_std=normalize_std)
    lengths_B = torch.tensor(lengths, dtype=torch.long)
    return RolloutBatch(
        tokens_BT, mask_BT, logp_sparse_BT, advantages_B, rewards_B, versions_BT, lengths_B, turn_BT=turn_BT
    )
