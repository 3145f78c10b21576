"""The trainer's view of the prompt data: `trainer.data` examples, tokenized once, served in the
sampler's resumable order (its state goes into the checkpoint)."""

from __future__ import annotations

from typing import Any

from sparserl_mcore.config import DataConfig
from sparserl_mcore.trainer.data import Example, PromptSampler, load_datasets
from sparserl_mcore.trainer.rollouts import Prompt


class PromptData:
    """Train prompts in seeded epochs and the held-out eval split, tokenized with the policy's tokenizer."""

    def __init__(self, cfg: DataConfig, tokenizer_dir: str, *, seed: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        train, held_out = load_datasets(cfg, seed=seed)
        self.train = [self._prompt(e) for e in train]
        self.eval = [self._prompt(e) for e in held_out]
        self.sampler = PromptSampler(len(self.train), seed=seed, shuffle=cfg.shuffle)

    def _prompt(self, example: Example) -> Prompt:
        ids = self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        return Prompt(input_ids=tuple(ids), answer=example.answer, text=example.prompt)

    def next_prompts(self, n: int) -> list[Prompt]:
        return [self.train[i] for i in self.sampler.next_indices(n)]

    def eval_prompts(self, limit: int | None) -> list[Prompt]:
        return self.eval[:limit] if limit else list(self.eval)

    def decode(self, ids: tuple[int, ...]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
