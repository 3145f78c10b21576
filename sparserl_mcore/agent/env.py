"""The environment contract of multi-turn episodes, and the `rollout.env` config section.

A user writes an `Env`: `reset(row)` turns a data row into the first prompt text, `step(turn)`
reads what the policy sampled in one turn and answers with a `Reply` (more text for the policy,
or the end of the episode). The framework owns the token stream (agent/trajectory.py), so an
environment never sees or produces token ids: that is what keeps the trajectory token-in/token-out.
A fresh instance is made per episode (`Env()`: no constructor arguments), so an environment may
keep the episode's state on `self`.

Environments are named like rewards: a key of `ENVS` (the built-ins, agent/envs/) or an import
path `package.module:Class`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Awaitable
from typing import Any, Literal

TurnFinish = Literal["stop", "eos", "length"]


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the policy sampled in one turn. text: the decoded view of the sampled ids (read-only:
    the trajectory keeps the ids themselves); index: 0-based turn number; finish_reason: "stop"
    (one of `Env.stop` matched), "eos" (an end-of-sequence or stop token id) or "length" (the turn's
    token budget ran out)."""

    text: str
    index: int
    finish_reason: TurnFinish


@dataclasses.dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn: `observation` text appended after it (encoded on its
    own), or `done` to end the episode. Rewards of all the episode's Replies are summed."""

    observation: str = ""
    done: bool = False
    reward: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.observation, str):
            raise TypeError(f"Reply.observation must be a str, got {type(self.observation).__name__}")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise TypeError(f"Reply.reward must be a finite number, got {self.reward!r}")


class Env:
    """Subclass and implement `reset` and `step` (a coroutine or a plain function).

    stop: strings that end a turn besides EOS (matched on the decoded output; the matched text
    stays in the trajectory)."""

    stop: tuple[str, ...] = ()

    def reset(self, row: dict[str, Any]) -> str:
        """The data row -> the first prompt text."""
        raise NotImplementedError

    def step(self, turn: Turn) -> Reply | Awaitable[Reply]:
        """One turn's sampled text -> the environment's Reply."""
        raise NotImplementedError


# name -> "module:Class" of the built-in environments (imported on use). Exhaustive.
ENVS: dict[str, str] = {
    "calculator": "sparserl_mcore.agent.envs.calculator:Calculator",
    "lookup_chain": "sparserl_mcore.agent.envs.lookup_chain:LookupChain",
}


def resolve_env(name: str) -> type[Env]:
    """The Env class for a built-in name or `module:Class`; ValueError (one line) otherwise."""
    path = ENVS.get(name, name)
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"rollout.env.name={name!r}: not a built-in environment ({', '.join(ENVS)}) nor an import "
            "path package.module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"rollout.env.name={name!r}: cannot import module {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"rollout.env.name={name!r}: module {module_name} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(
            f"rollout.env.name={name!r}: {attr} is not a subclass of sparserl_mcore.agent.Env "
            f"(got {type(cls).__name__} {cls!r})"
        )
    if not isinstance(cls.stop, tuple) or not all(isinstance(s, str) and s for s in cls.stop):
        raise ValueError(f"rollout.env.name={name!r}: {attr}.stop must be a tuple of non-empty strings")
    return cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """`rollout.env`: multi-turn episodes instead of single completions (docs/agents.md).

    max_turns: policy turns per episode at most. max_tokens_per_turn: a turn's max_new_tokens,
    clamped to the episode budget and the context left. max_episode_tokens: sampled + environment
    tokens after the first prompt. tool_timeout_s: longest `Env.step`; a step that takes longer (or
    raises) ends its episode with reason tool_timeout (tool_error). renderer: "plain" encodes text
    as is (raw or tiny models), "chat" applies the tokenizer's chat template (the observation as a
    `tool_role` message). on_truncation: "keep" trains truncated episodes (every end but the
    environment's done), "mask" zeroes their loss mask.
    """

    name: str
    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_episode_tokens: int = 1024
    tool_timeout_s: float = 30.0
    renderer: Literal["plain", "chat"] = "plain"
    tool_role: str = "tool"
    on_truncation: Literal["keep", "mask"] = "keep"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name is empty: a built-in environment or package.module:Class")
        for field in ("max_turns", "max_tokens_per_turn", "max_episode_tokens"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field}={value}: must be >= 1")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s={self.tool_timeout_s}: must be > 0 seconds")
