"""Synthetic, verifiable "long reasoning" tasks a tiny model can learn on CPU.

`DigitChainTask` (the demo's): lagged-Fibonacci digit chains. Every generated digit depends only
on RECENT generated state, so a policy under a small KV budget (StreamingLLM: sinks + recent
window) can still solve it, while the evicted positions still shift its distribution: a real
sampler/learner mismatch for the Sparse-RL correction, not a task compression makes impossible.
Its demonstrations (`solution`, what the supervised warm start imitates) can carry a systematic
slip on carry steps (`carry_slip`), while the `answer` the reward checks is always right: the
warm-started policy then knows the format and most of the rule but is wrong on one sub-case of
it, which RL can fix for every prompt at once.

`WorkedChainTask`: the same chain with its work shown, `a+b=c` per digit: a six-times longer
answer, mostly copied tokens around the one sum that decides each step (a CoT-shaped trace).

`RunningSumTask`: labelled running sums, whose every step copies a prompt digit; any compression
that evicts the prompt destroys the answer (measured in docs/benchmarks.md, "Warm start").

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
is one token: a completion is `7 * length + 2` tokens plus EOS (86 for 12 digits).
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


CHAIN_PREFIX = "chain "


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitChainTask:
    """Digit chains x[t] = (x[t-1] + x[t-lag]) mod 10 from `lag` seed digits (lag 2: Fibonacci mod 10)::

        prompt:     "chain 37"           (lag 2: seeds 3 7; offset 0)
        prompt:     "chain 3707"         (the same chain, offset 2: two of its digits already given)
        completion: "0774156178..."      (the next `length` digits: 3+7=0, 7+0=7, 0+7=7, 7+7=4, ...)

    The answer is the completion, scored by `digit_chain_reward` (correct-prefix share). Each step
    reads two tokens at fixed distances 1 and `lag` back; the completion continues the prompt's
    digits with no separator, so its first digit follows the same rule as the rest. The random
    offset (0..max_offset chain digits already in the prompt) is what makes a held-out prompt
    solvable: without it lag 2 has only 100 prompts, and the model memorised each training prompt's
    chain by its distance from the start and scored 0 on held-out seeds; with it the model must find
    its place from the recent digits, i.e. learn the local rule that compressed KV still allows.
    Knobs: `length` (difficulty, and the generation length: one token per digit, then EOS), `lag`
    (lag 3 did not start to learn within 1500 warm-start steps of the demo model) and `max_offset`.

    carry_slip: the chance that a demonstration writes a carry step (x[t-1] + x[t-lag] >= 10,
    45% of the digit pairs) as (x[t-1] + x[t-lag] + 1) mod 10, like a pupil who always carries the
    one. Each step slips independently and the demonstration continues from what it wrote, so it
    follows the right rule everywhere else. Above 0.5 a policy that imitates the demonstrations
    writes the slip greedily (greedy reward near 0) but samples the right digit 1 - carry_slip of
    the time: the reward, which checks the true chain (`answer`), tells the two apart.
    """

    length: int = 40
    lag: int = 2
    max_offset: int = 4
    carry_slip: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.lag <= 6:
            raise ValueError(f"lag={self.lag}: must be in 2..6 (seed digits in the prompt)")
        if self.length < 1:
            raise ValueError(f"length={self.length}: must be >= 1 (digits to generate)")
        if self.max_offset < 0:
            raise ValueError(f"max_offset={self.max_offset}: must be >= 0 (chain digits given in the prompt)")
        if not 0.0 <= self.carry_slip <= 1.0:
            raise ValueError(f"carry_slip={self.carry_slip}: must be in [0, 1] (chance a carry step slips)")

    def chain(self, seeds: list[int], n: int, slip_rng: random.Random | None = None) -> str:
        """The `n` digits that follow `seeds`; with `slip_rng`, carry steps slip at `carry_slip`."""
        digits = list(seeds)
        for _ in range(n):
            total = digits[-1] + digits[-self.lag]
            slip = slip_rng is not None and total >= 10 and slip_rng.random() < self.carry_slip
            digits.append((total + slip) % 10)
        return "".join(map(str, digits[len(seeds) :]))

    def sample(self, rng: random.Random) -> dict[str, str]:
        seeds = [rng.randrange(10) for _ in range(self.lag)]
        return self.example(seeds, offset=rng.randint(0, self.max_offset), slip_rng=rng)

    def example(
        self, seeds: list[int], *, offset: int = 0, slip_rng: random.Random | None = None
    ) -> dict[str, str]:
        """The prompt holds `seeds` and the first `offset` chain digits; the answer the next `length`.
        The solution is the answer, or with `slip_rng` and `carry_slip` > 0 a demonstration with slips."""
        if len(seeds) != self.lag or not all(0 <= d <= 9 for d in seeds):
            raise ValueError(f"seeds={seeds}: need exactly lag={self.lag} digits 0-9")
        if not 0 <= offset <= self.max_offset:
            raise ValueError(f"offset={offset}: must be in 0..max_offset={self.max_offset}")
        digits = "".join(map(str, seeds)) + self.chain(seeds, offset + self.length)
        given, chain = digits[: self.lag + offset], digits[self.lag + offset :]
        solution = chain
        if slip_rng is not None and self.carry_slip > 0:
            solution = self.chain([int(d) for d in given[-self.lag :]], self.length, slip_rng)
        return {"prompt": CHAIN_PREFIX + given, "answer": chain, "solution": solution}

    def completion_tokens(self) -> int:
        """Tokens of the tiny tokenizer in a reference completion, EOS excluded."""
        return self.length


WORK_PREFIX = "work "


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkedChainTask:
    """The lag-2 digit chain with its work shown: each step is written `a+b=c` (the two previous
    digits, then their sum mod 10), steps separated by a space::

        prompt:     "work 37"                   (seeds 3 7; offset 0, as DigitChainTask)
        completion: "3+7=0 7+0=7 0+7=7 7+7=4"   (4 steps; then EOS)

    The answer is six tokens per chain digit (6 * steps - 1), five of them copies of a token at
    most six positions back, one the sum that decides the step: a long, CoT-shaped trace whose
    every token a recent-window KV cache still sees. Prompts, offsets and carry slips are those of
    `DigitChainTask(length=steps, lag=2, ...)` (same draws for the same seed); the demonstration
    (`solution`) writes the slipped chain, the `answer` the reward (`worked_chain_reward`: share of
    steps right before the first wrong one) checks is the true one.
    """

    steps: int = 12
    max_offset: int = 4
    carry_slip: float = 0.0

    def __post_init__(self) -> None:
        self.chain_task()  # validates steps, max_offset and carry_slip

    def chain_task(self) -> DigitChainTask:
        return DigitChainTask(
            length=self.steps, lag=2, max_offset=self.max_offset, carry_slip=self.carry_slip
        )

    @staticmethod
    def worked(given: str, digits: str) -> str:
        """`digits` continuing the chain after `given` (>= 2 digits), written as steps `a+b=c`."""
        seq = given[-2:] + digits
        return " ".join(f"{seq[i]}+{seq[i + 1]}={seq[i + 2]}" for i in range(len(digits)))

    def sample(self, rng: random.Random) -> dict[str, str]:
        row = self.chain_task().sample(rng)
        given = row["prompt"].removeprefix(CHAIN_PREFIX)
        return {
            "prompt": WORK_PREFIX + given,
            "answer": self.worked(given, row["answer"]),
            "solution": self.worked(given, row["solution"]),
        }

    def completion_tokens(self) -> int:
        """Tokens of the tiny tokenizer in a reference completion, EOS excluded."""
        return 6 * self.steps - 1


Task = RunningSumTask | DigitChainTask | WorkedChainTask
# The second task of the DGG study (benchmarks/bench_dgg.py): the demo's chains, 12 worked steps
# (a 71-token answer), the same 60% carry slip in the demonstrations.
WORKED_TASK = WorkedChainTask(steps=12, carry_slip=0.6)
# The demo's task: 8-12-token prompts, 24-digit answers; 60% of the demonstrations' carry steps slip.
DEMO_TASK = DigitChainTask(length=24, lag=2, carry_slip=0.6)


def generate(task: Task, n: int, seed: int) -> Iterator[dict[str, str]]:
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
    task: Task, out_dir: str | os.PathLike, *, n_train: int, n_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint prompts) under `out_dir`; returns both paths."""
    rows = list(generate(task, n_train + n_eval, seed))
    eval_rows = rows[n_train:]
    seen = {r["prompt"] for r in eval_rows}
    train_rows = [r for r in rows[:n_train] if r["prompt"] not in seen]
    out = Path(out_dir)
    return write_jsonl(train_rows, out / "train.jsonl"), write_jsonl(eval_rows, out / "eval.jsonl")
