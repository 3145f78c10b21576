"""Reward of the synthetic running-sum task (sparserl_mcore.trainer.tasks): exact final answer.

A completion ends with a line `=N`; the reward is 1.0 when the first such line holds exactly the
reference integer. Only the final answer is scored, like a math verifier: the intermediate steps
earn nothing by themselves, but a tiny model cannot get the answer without writing them.
"""

from __future__ import annotations

import re

ANSWER_MARK = "\n="
_FINAL = re.compile(r"\n=(-?\d+)(?!\d)")


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
