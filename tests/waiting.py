"""Waiting on a condition in tests: a deadline and the thing awaited named in the error.

Tests wait on events (a process exiting, a socket connection, a line of output) where one exists,
and otherwise on an observable condition (a health endpoint, a file the code under test writes, a
scheduler state) through `wait_until`, never on a fixed sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Re-check `condition` every `interval` s until it returns something truthy (returned); a
    TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        pause.wait(interval)


def event_after_call(monkeypatch, obj: object, name: str) -> threading.Event:
    """An Event set each time `obj.name(...)` has returned (the method is wrapped for this test):
    e.g. a server handed a request to its worker."""
    done = threading.Event()
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        done.set()
        return result

    monkeypatch.setattr(obj, name, wrapper)
    return done
