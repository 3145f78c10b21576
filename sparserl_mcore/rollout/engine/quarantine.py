"""Finding the request behind a failed engine step, without failing the others.

A step runs one forward over every running request, so an exception there (a kernel error, an
out-of-memory, a bug that one prompt's shape triggers) cannot be pinned on one request. The
scheduler retracts every request of the failed step (their resources are released and they restart
from their prompts) and hands them here as suspects. The suspects are rerun in two halves, one half
at a time and with nothing else admitted beside it, until either a half completes (its members were
innocent) or a failing step holds a single suspect, which is then failed alone. A deterministic
culprit among n requests is found after at most log2(n) + 1 failed steps; a transient failure
costs one restart of the batch. Greedy and seeded requests give the same output after the restart.
"""

from __future__ import annotations

import logging
from collections import deque

from sparserl_mcore.rollout.engine.request_state import RequestState

log = logging.getLogger("sparserl_mcore.rollout.engine.scheduler")
_logged_failures: set[str] = set()


class Quarantine:
    """Suspect groups waiting to be probed, and the group probed now."""

    def __init__(self) -> None:
        self._groups: deque[list[RequestState]] = deque()
        self._probing: list[RequestState] = []

    @property
    def active(self) -> bool:
        self._advance()
        return bool(self._probing)

    def admits(self, r: RequestState) -> bool:
        """May `r` start now? While a group is probed, only its members may."""
        self._advance()
        return not self._probing or any(r is m for m in self._probing)

    def after_failure(self, involved: list[RequestState]) -> RequestState | None:
        """A step failed with `involved` running (already retracted). Returns the culprit when the
        failure has a single suspect left; otherwise queues the suspects in halves and returns None."""
        self._advance()
        suspects = [r for r in self._probing if not r.done] if self._probing else list(involved)
        self._probing = []
        if len(suspects) == 1:
            return suspects[0]
        if suspects:
            half = len(suspects) // 2
            self._groups.appendleft(suspects[half:])
            self._groups.appendleft(suspects[:half])
        return None

    def _advance(self) -> None:
        """Move on once every member of the probed group has finished (or failed)."""
        while (not self._probing or all(r.done for r in self._probing)) and self._groups:
            self._probing = self._groups.popleft()
        if self._probing and all(r.done for r in self._probing):
            self._probing = []


def log_step_failure(exc: Exception, involved: int) -> None:
    """One line per failure; the traceback only the first time an error message is seen, so a
    failure repeated while its culprit is isolated does not flood the log."""
    line = f"engine step failed with {involved} requests involved: {type(exc).__name__}: {exc}"
    key = f"{type(exc).__name__}: {exc}"
    if key in _logged_failures:
        log.warning(line)
    else:
        if len(_logged_failures) > 256:
            _logged_failures.clear()
        _logged_failures.add(key)
        log.warning(line, exc_info=exc)
