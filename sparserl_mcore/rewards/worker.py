"""The reward process: `python -m sparserl_mcore.rewards.worker`, started by `rewards.runner`.

It builds the reward named on its first stdin line ({"name", "kwargs"}), answers {"ready": true},
then scores one {"completion", "answer"} line at a time with {"reward": value} or {"error": text}.
Replies go to the original stdout; whatever the reward prints lands on stderr (the rank's log), so
it cannot break the protocol.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from sparserl_mcore.parallel.rank_entry import HELPER_IGNORED_SIGNALS


def _reply(out: Any, **fields: Any) -> None:
    out.write(json.dumps(fields) + "\n")  # NaN and inf travel as JSON's NaN / Infinity tokens
    out.flush()


def _score(reward: Any, request: dict[str, Any]) -> dict[str, Any]:
    try:
        value = reward(request["completion"], request["answer"])
    except Exception as exc:  # noqa: BLE001 - user code: any exception is the reward's failure
        return {"error": f"raised {type(exc).__name__}: {exc}"}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # numpy and torch scalars convert; strings, None and lists do not
            value = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, AttributeError):
            return {"error": f"returned {value!r:.60}, not a number"}
    return {"reward": float(value)}


def main() -> int:
    # Its runner owns its lifetime (kill past the timeout, end of input when the trainer exits): a
    # Ctrl-C or SIGTERM reaching the whole process group must not end it under a stopping trainer,
    # which finishes its step (and may score rewards) before it stops.
    for sig in HELPER_IGNORED_SIGNALS:  # blocked from the start (`runner.spawn_worker`) until now
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_IGNORED_SIGNALS)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the reward's prints go to stderr
    from sparserl_mcore.rewards import build_reward

    spec = json.loads(sys.stdin.readline())
    try:
        reward = build_reward(spec["name"], spec["kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the runner as one line
        _reply(out, error=f"cannot be built: {type(exc).__name__}: {exc}")
        return 1
    _reply(out, ready=True)
    for line in sys.stdin:
        _reply(out, **_score(reward, json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
