"""A synthetic, verifiable "long reasoning" task a tiny model can learn on CPU: labelled running sums.

The prompt lists labelled digits; the completion works through them label by label, writing
the digit, the running sum so far and the new running sum modulo `modulus`, then the final
answer on its own line::

    prompt:     "sum a3b1c4\\n"
    completion: "a3+0=3 b1+3=4 c4+4=8\\n=8"      (answer "8"; then the model's EOS token)

Each step needs one long-range lookup, the digit after the same label in the prompt (an
induction-style copy), and otherwise only nearby tokens (the previous sum, the digit just
written). A model cannot produce the final answer without writing the steps, and once KV
compression has evicted the prompt's digits it can no longer copy them: that is what makes the
KV budget bite. With the character-level tokenizer of `sparserl model make-tiny` every character
is one token: a completion is `7 * length + 2` tokens plus EOS (86 for the demo's 12 digits).
Difficulty knobs: `min_length..max_length` (digits per prompt, drawn per example) and `modulus`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
from collections.abc import Iterator
from pathlib import Path

from sparserl_mcore.rewards.synthetic import ANSWER_MARK

LABELS = string.ascii_lowercase + string.ascii_uppercase
PROMPT_PREFIX = "sum "


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunningSumTask:
    """Labelled running sums modulo `modulus` over `min_length..max_length` digits."""

    min_length: int = 12
    max_length: int = 12
    modulus: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.min_length <= self.max_length <= len(LABELS):
            raise ValueError(
                f"min_length={self.min_length}, max_length={self.max_length}: need "
                f"1 <= min_length <= max_length <= {len(LABELS)} (one label per digit)"
            )
        if not 2 <= self.modulus <= 10:
            raise ValueError(f"modulus={self.modulus}: must be in 2..10 so every sum is one digit")

    def sample(self, rng: random.Random) -> dict[str, str]:
        """One example: prompt, answer (the final sum) and the full reference solution."""
        n = rng.randint(self.min_length, self.max_length)
        digits = [rng.randrange(10) for _ in range(n)]
        return self.example(digits)

    def example(self, digits: list[int]) -> dict[str, str]:
        labels = LABELS[: len(digits)]
        total, steps = 0, []
        for label, d in zip(labels, digits, strict=True):
            new = (total + d) % self.modulus
            steps.append(f"{label}{d}+{total}={new} ")
            total = new
        prompt = PROMPT_PREFIX + "".join(f"{lab}{d}" for lab, d in zip(labels, digits, strict=True)) + "\n"
        return {
            "prompt": prompt,
            "answer": str(total),
            "solution": "".join(steps).rstrip() + f"{ANSWER_MARK}{total}",
        }

    def completion_tokens(self) -> int:
        """Characters (= tokens of the tiny tokenizer) of the longest reference completion, EOS excluded."""
        step = len("a0+0=0 ")
        return step * self.max_length - 1 + len(ANSWER_MARK) + 1


DEMO_TASK = RunningSumTask(min_length=12, max_length=12)  # 86-token completions, ~29-token prompts


def generate(task: RunningSumTask, n: int, seed: int) -> Iterator[dict[str, str]]:
    """`n` examples, deterministic in `seed`."""
    rng = random.Random(seed)
    for _ in range(n):
        yield task.sample(rng)


def write_jsonl(rows: list[dict[str, str]], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_splits(
    task: RunningSumTask, out_dir: str | os.PathLike, *, n_train: int, n_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint prompts) under `out_dir`; returns both paths."""
    rows = list(generate(task, n_train + n_eval, seed))
    eval_rows = rows[n_train:]
    seen = {r["prompt"] for r in eval_rows}
    train_rows = [r for r in rows[:n_train] if r["prompt"] not in seen]
    out = Path(out_dir)
    return write_jsonl(train_rows, out / "train.jsonl"), write_jsonl(eval_rows, out / "eval.jsonl")
