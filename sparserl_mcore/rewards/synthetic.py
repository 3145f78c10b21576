"""Rewards of the synthetic tasks (sparserl_mcore.trainer.tasks).

running_sum: a completion ends with a line `=N`; the reward is 1.0 when the first such line holds
exactly the reference integer. Only the final answer is scored, like a math verifier.

digit_chain: the share of the reference chain the completion reproduces before its first wrong
digit. Partial credit on purpose: with exact match a 40-digit chain sampled at T=1 is almost never
all right, so most GRPO groups would have zero variance; the correct-prefix share still ranks a
group's samples, and only an all-correct chain earns 1.0.

worked_chain: the same, counted in worked steps `a+b=c` (trainer/tasks.py WorkedChainTask): the
share of the reference's steps the completion writes exactly, in order, before its first wrong one.
"""

from __future__ import annotations

import re

ANSWER_MARK = "\n="
_FINAL = re.compile(r"\n=(-?\d+)(?!\d)")
_STEP = re.compile(r"\d\+\d=\d")


def parse_final_answer(completion: str) -> int | None:
    """The integer of the first `\\n=N` line of `completion`, or None if there is none."""
    match = _FINAL.search("\n" + completion if completion.startswith("=") else completion)
    return int(match.group(1)) if match else None


def running_sum_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the integer `answer`, else 0.0."""
    try:
        expected = int(str(answer).strip())
    except ValueError as exc:
        raise ValueError(f"running_sum reward: reference answer {answer!r} is not an integer") from exc
    return 1.0 if parse_final_answer(completion) == expected else 0.0


def digit_chain_reward(completion: str, answer: str) -> float:
    """Share of `answer` (the reference digit chain) matched by the start of `completion` up to its
    first wrong character, in [0, 1]. What follows a complete chain (EOS, junk) is ignored."""
    if not answer or not answer.isdigit():
        raise ValueError(f"digit_chain reward: reference answer {answer!r} is not a non-empty digit string")
    matched = 0
    for got, want in zip(completion, answer, strict=False):
        if got != want:
            break
        matched += 1
    return matched / len(answer)


def worked_chain_reward(completion: str, answer: str) -> float:
    """Share of the reference's space-separated steps `a+b=c` that `completion` writes exactly (each
    with the space after it, but the last) before its first wrong step, in [0, 1]. What follows the
    last step (EOS, junk) is ignored, as in `digit_chain_reward`."""
    steps = answer.split(" ")
    if not all(_STEP.fullmatch(step) for step in steps):
        raise ValueError(f"worked_chain reward: reference answer {answer!r} is not steps like '3+7=0 7+0=7'")
    matched = pos = 0
    for i, step in enumerate(steps):
        end = pos + len(step) + (i < len(steps) - 1)  # the step and the space after it
        if completion[pos:end] != answer[pos:end]:
            break
        matched, pos = matched + 1, end
    return matched / len(steps)
