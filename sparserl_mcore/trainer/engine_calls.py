"""One engine call of the `EnginePool` (`trainer/engine_pool.py`), on a worker thread of its own:
the call, its answer cut back into chunks, and the engine's health asked after a failure."""

from __future__ import annotations

import queue
from typing import Any

from sparserl_mcore.rollout.protocol import RequestsFailed

# one call's answer: (engine, [(chunk, its samples or None, the error)], engine healthy after a failure)
Answer = tuple[str, list[tuple[Any, list[Any] | None, str]], bool | None]


def oldest_version(samples: list[Any]) -> int:
    """The oldest weight version any token of `samples` was sampled at."""
    return min((min(s.token_versions(), default=s.weight_version) for s in samples), default=1 << 62)


def is_healthy(engine: Any) -> bool | None:
    """The engine's own health check (`health()`), None when it has none."""
    check = getattr(engine, "health", None)
    if not callable(check):
        return None
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - an engine that cannot say is not healthy
        return False


def call_engine(name: str, engine: Any, chunks: list[Any], inbox: queue.Queue) -> None:
    """One `generate` for all of `chunks`, answered as one item of per-chunk results (a short
    answer is then caught per chunk by the request ids; `RequestsFailed` fails only the chunks
    holding a failed request). After a failure the engine's health is asked at once."""
    flat = [r for chunk in chunks for r in chunk.requests]
    try:
        outcomes: list[Any] = list(engine.generate(flat))
    except RequestsFailed as exc:
        outcomes = exc.outcomes
    except Exception as exc:  # reported to the pool, which retries the chunks
        error = f"generate failed: {type(exc).__name__}: {exc}"
        inbox.put((name, [(chunk, None, error) for chunk in chunks], is_healthy(engine)))
        return
    results: list[tuple[Any, list[Any] | None, str]] = []
    start, failed = 0, False
    for chunk in chunks:
        part = outcomes[start : start + len(chunk.requests)]
        start += len(chunk.requests)
        errors = [o for o in part if isinstance(o, BaseException)]
        if errors:
            failed = True
            results.append((chunk, None, f"generate failed: {type(errors[0]).__name__}: {errors[0]}"))
        else:
            results.append((chunk, part, ""))
    inbox.put((name, results, is_healthy(engine) if failed else None))
