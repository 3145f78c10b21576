"""lookup_chain: pointer chasing through a hidden table, solvable only by calling the lookup tool.

A row holds a hidden random table T (digit -> digit), a start digit s and a hop count h. The policy
sees only `hop 2 from 7\\n`; it calls the tool with `?7;` (`;` ends the turn) and the environment
answers `=4 r1\\n`: T(7) and the hops remaining. At `r0` the policy answers `!9` and stops (EOS);
the reward is 1 when the answer equals T^h(s). A blind guess is right one time in ten, so the tool
calls are the only way up. Every decision is local (copy the last value into the next call, or
into the answer at r0), so a two-layer character-level model can learn it, under compressed KV too.

Rows (JSONL): `{"prompt": "hop 2 from 7\\n", "answer": "<json>"}` where the answer column holds
`{"table": "3917284650", "start": 7, "hops": 2}` (`make_row`); `write_splits` writes train and
eval files, `warm_start_rows` the warm start's demonstrations (a share of which answer one hop
early, so RL has to learn to make the last call).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from sparserl_mcore.agent.env import Env, Reply, Turn
from sparserl_mcore.trainer.tasks import write_jsonl

_CALL = re.compile(r"\?(\d);$")
_ANSWER = re.compile(r"!(\d)")


def make_row(rng: random.Random, max_hops: int = 3) -> dict[str, str]:
    """One random episode: a table, a start and 1..max_hops hops."""
    table = "".join(str(rng.randrange(10)) for _ in range(10))
    start, hops = rng.randrange(10), rng.randint(1, max_hops)
    info = {"table": table, "start": start, "hops": hops}
    return {"prompt": f"hop {hops} from {start}\n", "answer": json.dumps(info)}


def target(info: dict[str, Any]) -> int:
    """T^h(s): the digit the episode must answer."""
    value = int(info["start"])
    for _ in range(int(info["hops"])):
        value = int(info["table"][value])
    return value


def demonstration(info: dict[str, Any], *, early: bool = False) -> str:
    """The text a correct episode writes (tool calls, observations, answer); `early` answers one
    hop early, with the value the last call but one returned (a slip the reward catches)."""
    value, hops, text = int(info["start"]), int(info["hops"]), ""
    for k in range(hops - 1 if early else hops):
        looked_up = int(info["table"][value])
        text += f"?{value};={looked_up} r{hops - k - 1}\n"
        value = looked_up
    return text + f"!{value}"


def write_splits(out_dir: str | os.PathLike, *, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of random episodes under `out_dir` (written atomically)."""
    rng = random.Random(seed)
    rows = [make_row(rng) for _ in range(n_train + n_eval)]
    out = Path(out_dir)
    return write_jsonl(rows[:n_train], out / "train.jsonl"), write_jsonl(rows[n_train:], out / "eval.jsonl")


def warm_start_rows(n: int, *, early: float, seed: int) -> list[dict[str, str]]:
    """(prompt, solution) rows for `trainer.warmstart.warm_start`: demonstrations of which a share
    `early` answer one hop early."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = make_row(rng)
        solution = demonstration(json.loads(row["answer"]), early=rng.random() < early)
        rows.append({"prompt": row["prompt"], "solution": solution})
    return rows


class LookupChain(Env):
    """See the module docstring. A turn that is not a call ends the episode and is scored."""

    stop = (";",)

    def reset(self, row: dict[str, Any]) -> str:
        self.info = json.loads(row["answer"])
        self.left = int(self.info["hops"])
        return str(row["prompt"])

    def step(self, turn: Turn) -> Reply:
        call = _CALL.search(turn.text)
        if call is not None and turn.finish_reason == "stop":
            self.left = max(0, self.left - 1)
            return Reply(observation=f"={self.info['table'][int(call.group(1))]} r{self.left}\n")
        answer = _ANSWER.search(turn.text)
        correct = answer is not None and int(answer.group(1)) == target(self.info)
        return Reply(done=True, reward=1.0 if correct else 0.0)
