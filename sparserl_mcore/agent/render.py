"""Text -> token ids for the two kinds of text an episode adds: the first prompt and observations.

Sampled ids never pass through here: the trajectory appends them as the engine returned them
(token-in/token-out). An observation is encoded on its own, never together with history, and
history is never re-rendered, so turn k+1's input is turn k's input plus what was appended.

`PlainRenderer`: the text as is, no special tokens (raw or tiny models; the environment writes
every separator itself).

`ChatRenderer`: the tokenizer's chat template. The first prompt is a user message with the
generation prompt. An observation is a `tool_role` message: its ids are the suffix the template
adds to a fixed synthetic conversation (user, assistant) when the message and the next generation
prompt are appended, so the role headers come from the template and nothing before them is
rendered again. Boundary rule: the assistant turn is closed by the template's own closing text
(ChatML: `<|im_end|>\\n`); a turn that stopped at the closing token keeps it as sampled and gets
only the rest, a turn that stopped at a stop string or ran out of tokens gets all of it. The
closing token is also a stop token of every turn. A template whose rendering of the longer
conversation does not extend the shorter one (it rewrites history, as Qwen3's strips past
thinking) is refused: such a model's episodes would not be append-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

_USER, _ASSISTANT = "U", "A\x1f"  # the synthetic base conversation (the marker never occurs in text)


class Renderer(Protocol):
    """What an episode needs from text: ids of the first prompt, of an observation after a turn."""

    stop_token_ids: tuple[int, ...]

    def prompt(self, text: str) -> list[int]: ...

    def observation(self, text: str, sampled: Sequence[int]) -> list[int]: ...


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PlainRenderer:
    """Text encoded as is, without special tokens."""

    stop_token_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt(self, text: str) -> list[int]:
        return _encode(self.tokenizer, text)

    def observation(self, text: str, sampled: Sequence[int]) -> list[int]:
        del sampled
        return _encode(self.tokenizer, text)


class ChatRenderer:
    """The tokenizer's chat template, append-only (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, tool_role: str = "tool") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("renderer=chat: the tokenizer has no chat_template; use renderer=plain")
        self.tokenizer, self.tool_role = tokenizer, tool_role
        base = self._render([("user", _USER), ("assistant", _ASSISTANT)], generation=False)
        self._base = base
        self.closing = _encode(tokenizer, base[base.rindex(_ASSISTANT) + len(_ASSISTANT) :])
        if not self.closing:
            raise ValueError("renderer=chat: the chat template closes an assistant turn with no text")
        special = set(getattr(tokenizer, "all_special_ids", ()))
        self.stop_token_ids: tuple[int, ...] = (self.closing[0],) if self.closing[0] in special else ()

    def _render(self, messages: list[tuple[str, str]], *, generation: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=generation
        )
        assert isinstance(text, str)
        return text

    def prompt(self, text: str) -> list[int]:
        return _encode(self.tokenizer, self._render([("user", text)], generation=True))

    def observation(self, text: str, sampled: Sequence[int]) -> list[int]:
        full = self._render(
            [("user", _USER), ("assistant", _ASSISTANT), (self.tool_role, text)], generation=True
        )
        if not full.startswith(self._base):
            raise ValueError(
                "renderer=chat: the chat template renders earlier messages differently once a "
                f"{self.tool_role!r} message follows, so episodes could not be append-only"
            )
        closed = len(sampled) > 0 and sampled[-1] == self.closing[0]
        bridge = self.closing[1:] if closed else self.closing
        return bridge + _encode(self.tokenizer, full[len(self._base) :])


def build_renderer(kind: str, tokenizer: Any, *, tool_role: str = "tool") -> Renderer:
    """`rollout.env.renderer`: "plain" or "chat"."""
    if kind == "plain":
        return PlainRenderer(tokenizer)
    if kind == "chat":
        return ChatRenderer(tokenizer, tool_role=tool_role)
    raise ValueError(f"renderer={kind!r}: choose plain or chat")
