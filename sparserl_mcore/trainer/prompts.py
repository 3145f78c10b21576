"""Prompt rows from a local JSONL/Parquet file, tokenized, served in a seeded order with a position.

The order is a permutation per epoch drawn from (seed, epoch), so the loader's whole state is
(epoch, index): a checkpoint stores it and a resumed run gets exactly the prompts it would have had.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from sparserl_mcore.trainer.rollouts import Prompt


def read_rows(path: str, prompt_key: str, answer_key: str) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    else:
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise ValueError(f"{path} row {i}: missing column(s) {missing}; columns: {sorted(row)}")
    return rows


class PromptData:
    """Train prompts in seeded epochs and the held-out eval split, tokenized with the policy's tokenizer."""

    def __init__(self, cfg: Any, tokenizer_dir: str, *, seed: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        rows = read_rows(cfg.train_path, cfg.prompt_key, cfg.answer_key)
        if cfg.eval_path:
            eval_rows = read_rows(cfg.eval_path, cfg.prompt_key, cfg.answer_key)
        else:
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            n_eval = int(len(rows) * cfg.eval_fraction)
            held = set(order[:n_eval])
            eval_rows = [rows[i] for i in sorted(held)]
            rows = [r for i, r in enumerate(rows) if i not in held]
        if not rows:
            raise ValueError(f"{cfg.train_path}: no training prompts left")
        self.train = [self._prompt(r, cfg) for r in rows]
        self.eval = [self._prompt(r, cfg) for r in eval_rows]
        self.shuffle, self.seed = cfg.shuffle, seed
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order()

    def _prompt(self, row: dict[str, Any], cfg: Any) -> Prompt:
        ids = self.tokenizer(str(row[cfg.prompt_key]), add_special_tokens=False)["input_ids"]
        return Prompt(input_ids=tuple(ids), answer=str(row[cfg.answer_key]))

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.train)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_prompts(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order()
            out.append(self.train[self._order[self.index]])
            self.index += 1
        return out

    def eval_prompts(self, limit: int | None) -> list[Prompt]:
        return self.eval[:limit] if limit else list(self.eval)

    def decode(self, ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._epoch_order()
