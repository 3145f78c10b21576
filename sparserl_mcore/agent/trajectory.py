"""An episode's token stream, append-only: prompt, then per turn the sampled ids and the
environment's ids, with the loss mask, sampler log-probs and versions written by the same append.

Shapes are per position of `tokens` (the convention of `trainer/batch.py` and `sparserl_mcore.loss`):
    loss_mask   1 on tokens the engine sampled, 0 on prompt, environment and boundary tokens
    logprobs    the sampler's log-prob of a sampled token, 0 elsewhere (never read there: masked)
    versions    the weight version that sampled it, 0 elsewhere
    turn_of     the turn that sampled it, -1 elsewhere
`append_sampled` refuses a sample whose request was not the whole trajectory so far: a history that
was decoded and encoded again, or rendered again, is caught there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sparserl_mcore.rollout.protocol import FinishReason, KVStats, Sample

# Why an episode ended. done: the environment said so; the others are truncations.
END_REASONS = ("done", "max_turns", "episode_tokens", "context", "tool_error", "tool_timeout", "abort")


class Trajectory:
    """The growing token stream of one episode (see the module docstring)."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise ValueError("an episode's first prompt encodes to no tokens")
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.loss_mask = [0] * self.prompt_len
        self.logprobs = [0.0] * self.prompt_len
        self.versions = [0] * self.prompt_len
        self.turn_of = [-1] * self.prompt_len
        self.samples: list[Sample] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def added(self) -> int:
        """Sampled + environment tokens after the first prompt (what max_episode_tokens bounds)."""
        return len(self.tokens) - self.prompt_len

    def append_sampled(self, sample: Sample, turn: int) -> None:
        if tuple(sample.prompt_ids) != tuple(self.tokens):
            raise ValueError(
                f"sample {sample.rid}: its request's input_ids are not this trajectory "
                f"({len(sample.prompt_ids)} vs {len(self.tokens)} tokens): history must be appended "
                "to, never re-encoded or re-rendered"
            )
        if len(sample.output_logprobs) != len(sample.output_ids):
            raise ValueError(f"sample {sample.rid}: log-probs and output ids differ in length")
        n = len(sample.output_ids)
        self.tokens += sample.output_ids
        self.loss_mask += [1] * n
        self.logprobs += sample.output_logprobs
        self.versions += sample.token_versions()
        self.turn_of += [turn] * n
        self.samples.append(sample)

    def append_env(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.tokens += ids
        self.loss_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [0] * n
        self.turn_of += [-1] * n

    def finish(self, rid: str, end_reason: str, reward: float, *, mask_truncated: bool) -> Episode:
        if end_reason not in END_REASONS:
            raise ValueError(f"end_reason={end_reason!r}: one of {END_REASONS}")
        keep = end_reason == "done" or not mask_truncated  # masked: nothing of it reaches the loss
        return Episode(
            rid=rid,
            tokens=tuple(self.tokens),
            loss_mask=tuple(m * keep for m in self.loss_mask),
            logprobs=tuple(lp * keep for lp in self.logprobs),
            versions=tuple(v * keep for v in self.versions),
            turn_of=tuple(self.turn_of),
            prompt_len=self.prompt_len,
            turns=tuple(self.samples),
            reward=reward,
            end_reason=end_reason,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Episode:
    """A finished episode: one training row with holes in its loss mask.

    It answers the per-sample questions the trainer's metrics ask of a `Sample` (prompt_ids,
    output_ids, finish_reason, kv_stats), so single- and multi-turn steps report the same way."""

    rid: str
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    turn_of: tuple[int, ...]
    prompt_len: int
    turns: tuple[Sample, ...]
    reward: float
    end_reason: str

    @property
    def truncated(self) -> bool:
        return self.end_reason != "done"

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.tokens[: self.prompt_len]

    @property
    def output_ids(self) -> tuple[int, ...]:
        return self.tokens[self.prompt_len :]

    @property
    def finish_reason(self) -> FinishReason:
        return "length" if self.truncated else "stop"

    @property
    def kv_stats(self) -> KVStats:
        """The turn that held the most KV."""
        return max((s.kv_stats for s in self.turns), key=lambda k: k.peak_kv_bytes, default=KVStats())
