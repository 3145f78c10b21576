"""calculator: arithmetic with a tool, the docs' example of an environment (docs/agents.md).

The policy writes `[3*17]` to call the calculator (`]` ends the turn) and gets `=51\\n` back; a turn
without a call is its final answer, scored 1.0 when its last integer equals the row's answer.
Only + - * and integers are evaluated (no `eval`): a malformed call raises, which ends the
episode with reason tool_error.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from sparserl_mcore.agent.env import Env, Reply, Turn

_CALL = re.compile(r"\[([^\[\]]*)\]$")
_INT = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expr: str) -> int:
    """An integer expression over + - * and parentheses; ValueError for anything else."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"calculator: cannot evaluate {expr!r}")

    return walk(ast.parse(expr.strip(), mode="eval").body)


class Calculator(Env):
    stop = ("]",)

    def reset(self, row: dict[str, Any]) -> str:
        self.answer = int(row["answer"])
        return str(row["prompt"])

    async def step(self, turn: Turn) -> Reply:
        call = _CALL.search(turn.text)
        if call is not None and turn.finish_reason == "stop":
            return Reply(observation=f"={evaluate(call.group(1))}\n")
        numbers = _INT.findall(turn.text)
        return Reply(done=True, reward=float(bool(numbers) and int(numbers[-1]) == self.answer))
