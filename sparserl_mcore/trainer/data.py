"""Prompt datasets: local JSONL / Parquet files, a held-out eval split, and a resumable sampler.

The sampler walks deterministic shuffled epochs: epoch e is a permutation seeded by (seed, e), and
its whole state is (epoch, offset). A run resumed from a checkpoint therefore sees exactly the
prompts an uninterrupted run would have seen, which bit-identical resume needs.

    train, held_out = load_datasets(cfg.data, seed=cfg.train.seed)
    sampler = PromptSampler(len(train), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    batch = [train[i] for i in sampler.next_indices(cfg.train.prompts_per_step)]
    state = sampler.state_dict()          # into the checkpoint; sampler.load_state_dict(state)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sparserl_mcore.config import DataConfig

SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; `index` is its row in the source file, `where` names
    it for a message ("train.jsonl:17": the file's line; Parquet: "data.parquet:row 16")."""

    prompt: str
    answer: str
    index: int
    where: str = ""


def _check_value(value: Any, key: str, where: str) -> str:
    if value is None:
        raise ValueError(f"{where}: {key!r} is null")
    if isinstance(value, (dict, list)):
        raise ValueError(f"{where}: {key!r} must be a string or number, got {type(value).__name__}")
    return str(value)


def _read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[Example]:
    rows: list[Example] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object per line")
            missing = [k for k in (prompt_key, answer_key) if k not in obj]
            if missing:
                raise ValueError(f"{where}: missing key {missing[0]!r}; keys present: {sorted(obj)}")
            prompt = _check_value(obj[prompt_key], prompt_key, where)
            rows.append(Example(prompt, _check_value(obj[answer_key], answer_key, where), len(rows), where))
    return rows


def _read_parquet(path: Path, prompt_key: str, answer_key: str) -> list[Example]:
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    missing = [k for k in (prompt_key, answer_key) if k not in names]
    if missing:
        raise ValueError(f"{path}: missing column {missing[0]!r}; columns present: {names}")
    table = pq.read_table(path, columns=[prompt_key, answer_key])
    prompts, answers = table.column(prompt_key).to_pylist(), table.column(answer_key).to_pylist()
    return [
        Example(
            _check_value(p, prompt_key, f"{path}:row {i}"),
            _check_value(a, answer_key, f"{path}:row {i}"),
            i,
            f"{path}:row {i}",
        )
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]


def read_examples(
    path: str | os.PathLike, *, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[Example]:
    """All rows of a .jsonl or .parquet file; errors name the file, line/row and key."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported dataset format {path.suffix!r}; use one of {SUFFIXES}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    reader = _read_jsonl if path.suffix == ".jsonl" else _read_parquet
    rows = reader(path, prompt_key, answer_key)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def load_datasets(cfg: DataConfig, *, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out eval) examples. Without `eval_path`, `eval_fraction` of the train file is
    held out by a permutation seeded with `seed`; those rows are never trained on."""
    keys = {"prompt_key": cfg.prompt_key, "answer_key": cfg.answer_key}
    train = read_examples(cfg.train_path, **keys)
    if cfg.eval_path:
        return train, read_examples(cfg.eval_path, **keys)
    n_eval = int(round(cfg.eval_fraction * len(train)))
    if cfg.eval_fraction and not 0 < n_eval < len(train):
        raise ValueError(
            f"data.eval_fraction={cfg.eval_fraction} of {len(train)} rows holds out {n_eval}; "
            "need at least one row in each split"
        )
    order = np.random.default_rng([seed, 0x5E1D]).permutation(len(train))
    held = set(order[:n_eval].tolist())
    return [e for e in train if e.index not in held], [e for e in train if e.index in held]


class PromptSampler:
    """Indices into a dataset of `n` rows, epoch after epoch, reproducible and resumable."""

    def __init__(self, n: int, *, seed: int, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError(f"PromptSampler: dataset is empty (n={n})")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_indices(self, k: int) -> list[int]:
        """The next `k` row indices; crosses into the next epoch (new permutation) when needed."""
        if k < 1:
            raise ValueError(f"next_indices: k={k} must be >= 1")
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.offset)
            out.extend(self._order[self.offset : self.offset + take].tolist())
            self.offset += take
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "n": self.n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuses a state taken over a different dataset or seed."""
        mine = {"n": self.n, "seed": self.seed, "shuffle": self.shuffle}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"sampler state {theirs} does not match this dataset/sampler {mine}")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.n:
            raise ValueError(f"sampler state epoch={epoch}, offset={offset} out of range for n={self.n}")
        self.epoch, self.offset = epoch, offset
        self._order = self._permutation(epoch)
