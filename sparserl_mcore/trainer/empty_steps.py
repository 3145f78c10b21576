"""A run that trains nothing must say so and stop, not end in "done".

A step trains nothing when no update moved the policy on a reward signal: the engines generated no
token, every group's rewards were equal (the zero-variance filter leaves no sequence, or every
advantage is 0), too few sequences were left to fill a micro-batch, or every update was skipped as
non-finite. Once is normal in RL (a hard batch); `train.max_empty_steps` in a row stops the run
with one line naming the cause (`NothingTrainedError`, exit code 5).

Groups holding a non-finite reward (kept as NaN only under `reward.skip_nonfinite`) are dropped
whole before the batch is built (`drop_nonfinite_groups`): GRPO's baseline needs every sample of
a group. Every rank runs the same code on the same broadcast samples, so all stop at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sparserl_mcore.rollout.protocol import Sample


class NothingTrainedError(RuntimeError):
    """`train.max_empty_steps` consecutive steps trained nothing; the message names the cause."""


def drop_nonfinite_groups(
    samples: Sequence[Sample], rewards: Sequence[float], group_size: int
) -> tuple[list[Sample], list[float], list[str]]:
    """(samples, rewards) without the groups holding a NaN reward, and the dropped samples' ids."""
    kept_s: list[Sample] = []
    kept_r: list[float] = []
    dropped: list[str] = []
    for start in range(0, len(samples), group_size):
        group = range(start, start + group_size)
        if any(math.isnan(rewards[i]) for i in group):
            dropped += [samples[i].rid for i in group if math.isnan(rewards[i])]
        else:
            kept_s += [samples[i] for i in group]
            kept_r += [rewards[i] for i in group]
    return kept_s, kept_r, dropped


def empty_cause(
    samples: Sequence[Sample],
    rewards: Sequence[float],
    metrics: Mapping[str, float],
    *,
    informative: int,
    trained_signal: bool,
    skipped_groups: int,
) -> str | None:
    """Why this step trained nothing, or None when it trained. `informative`: sequences in groups
    with reward variance (before the micro-batch trim); `trained_signal`: some trained sequence had
    a non-zero advantage and a response token."""
    if trained_signal and metrics.get("train/updates", 0) > 0:
        return None
    if not samples:
        return f"every group held a non-finite reward ({skipped_groups} groups skipped)"
    if not any(s.output_ids for s in samples):
        return "no tokens generated (every completion is empty: check rollout.sampling.max_new_tokens)"
    values = set(rewards)
    if len(values) == 1:
        return f"all rewards equal to {next(iter(values)):g}: no reward variance to learn from"
    if not informative:
        return "every group's rewards were equal within the group: no reward variance to learn from"
    if not trained_signal:
        return (
            f"only {informative} sequences had reward variance, fewer than one micro-batch "
            "(train.micro_batch_size) on each data-parallel rank"
        )
    if metrics.get("train/skipped_nonfinite", 0) > 0:
        return "every update had a non-finite loss or gradient and was skipped"
    return "no optimizer update was applied"


class EmptySteps:
    """Counts consecutive empty steps; `observe` raises NothingTrainedError at the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run = limit, 0

    def observe(self, cause: str | None) -> None:
        self.run = self.run + 1 if cause is not None else 0
        if cause is not None and self.limit and self.run >= self.limit:
            raise NothingTrainedError(
                f"stopped after {self.run} consecutive steps that trained nothing: {cause}; "
                f"train.max_empty_steps={self.limit} sets how many are allowed"
            )


def trained_signal(batch: Any) -> bool:
    """Some sequence of the (filtered, trimmed) batch has a non-zero advantage and a response token."""
    if batch.size == 0:
        return False
    has_tokens = batch.mask_BT.sum(dim=1) > 0
    return bool(((batch.advantages_B != 0) & has_tokens).any())
