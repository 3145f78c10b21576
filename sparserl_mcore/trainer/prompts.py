"""The trainer's view of the prompt data: `trainer.data` examples, tokenized once, served in the
sampler's resumable order (its state goes into the checkpoint).

A row the engines would refuse at every request (an empty prompt, or one leaving no room for
rollout.sampling.max_new_tokens in the model's context) is found here, at start-up, for both
splits: `sparserl train` refuses it before launch naming the file, the line and the lengths
(`tokenize_rows`, run by the preflight), or, with `data.skip_bad_rows`, every rank drops the same
rows, counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sparserl_mcore.config import DataConfig
from sparserl_mcore.trainer.data import Example, PromptSampler, load_datasets
from sparserl_mcore.trainer.rollouts import Prompt


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """The usable rows of one split as prompts, and one line per row that is not (in file order)."""

    prompts: list[Prompt]
    refused: list[str]


def tokenize_rows(
    examples: Sequence[Example], tokenizer: Any, *, max_new_tokens: int, context: int
) -> Tokenized:
    """Tokenize `examples`; a row with no prompt token, or with more than context - max_new_tokens,
    is refused (named by its file and line, with the lengths)."""
    prompts: list[Prompt] = []
    refused: list[str] = []
    for example in examples:
        ids = tuple(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
        if not ids:
            refused.append(f"{example.where}: the prompt is empty (0 tokens)")
        elif len(ids) + max_new_tokens > context:
            refused.append(
                f"{example.where}: the prompt has {len(ids)} tokens, and with "
                f"rollout.sampling.max_new_tokens={max_new_tokens} it exceeds the model's context of "
                f"{context} positions"
            )
        else:
            prompts.append(Prompt(input_ids=ids, answer=example.answer, text=example.prompt))
    return Tokenized(prompts, refused)


def bad_rows_message(refused: Sequence[str]) -> str:
    """One line for the first refused row, how many more there are, and the fixes."""
    more = f" ({len(refused) - 1} more rows like it)" if len(refused) > 1 else ""
    return (
        f"{refused[0]}{more}; fix the data, lower rollout.sampling.max_new_tokens, or set "
        "data.skip_bad_rows=true to skip such rows (counted)"
    )


def decode_ids(tokenizer: Any, ids: tuple[int, ...]) -> str:
    """A completion's text, as the reward reads it."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence in, one string out
    return text


def load_tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def tokenized_splits(
    cfg: DataConfig, tokenizer: Any, *, seed: int, max_new_tokens: int, context: int
) -> tuple[Tokenized, Tokenized]:
    """(train, held-out eval) splits, tokenized and checked (`tokenize_rows`)."""
    train, held_out = load_datasets(cfg, seed=seed)
    check = dict(max_new_tokens=max_new_tokens, context=context)
    return tokenize_rows(train, tokenizer, **check), tokenize_rows(held_out, tokenizer, **check)


class PromptData:
    """Train prompts in seeded epochs and the held-out eval split, tokenized with the policy's tokenizer."""

    def __init__(self, cfg: DataConfig, tokenizer_dir: str, *, seed: int, max_new_tokens: int, context: int):
        self.tokenizer = load_tokenizer(tokenizer_dir)
        train, held_out = tokenized_splits(
            cfg, self.tokenizer, seed=seed, max_new_tokens=max_new_tokens, context=context
        )
        refused = train.refused + held_out.refused
        if refused and not cfg.skip_bad_rows:  # the preflight refused them already, unless skipped
            raise ValueError(bad_rows_message(refused))
        if not train.prompts:
            raise ValueError(f"data: no usable training prompt left ({len(train.refused)} rows skipped)")
        self.train, self.eval = train.prompts, held_out.prompts
        self.sampler = PromptSampler(len(self.train), seed=seed, shuffle=cfg.shuffle)

    def next_prompts(self, n: int) -> list[Prompt]:
        return [self.train[i] for i in self.sampler.next_indices(n)]

    def eval_prompts(self, limit: int | None) -> list[Prompt]:
        return self.eval[:limit] if limit else list(self.eval)

    def decode(self, ids: tuple[int, ...]) -> str:
        return decode_ids(self.tokenizer, ids)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
