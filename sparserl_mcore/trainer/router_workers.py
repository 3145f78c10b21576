"""The SGLang workers behind the pool's sglang-router engines: which the router serves, and which
the trainer took out of it (dead, or a weight sync failed on them) and why.

The router holds no weights and keeps a dead worker registered (its own health checks, 60 s apart
by default, mark it unhealthy, then healthy again once a restarted one answers, at whatever
weights it holds), so the trainer decides who it routes to: a worker that fails the pool's health
check or a sync is taken out (`DELETE /workers/{id}`), and put back (`POST /workers`) only when the
pool re-admits it after a full weight sync (`EnginePool.admit`). The probing and the re-admission
backoff are the pool's.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any


class RouterWorkers:
    """Membership of the workers behind each router engine (by worker URL); thread-safe."""

    def __init__(self, engines: dict[str, Any]) -> None:
        self._router_of = {w.url: name for name, e in engines.items() for w in getattr(e, "workers", ())}
        self._workers = {w.url: w for e in engines.values() for w in getattr(e, "workers", ())}
        self._out: dict[str, str] = {}  # worker URL -> why it was taken out
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._workers)

    def owns(self, url: str) -> bool:
        return url in self._workers

    def worker(self, url: str) -> Any:
        return self._workers.get(url)

    def router_of(self, url: str) -> str:
        return self._router_of[url]

    def out(self) -> dict[str, str]:
        """A snapshot of the workers taken out, and why."""
        with self._lock:
            return dict(self._out)

    def serving(self, live_routers: Collection[str]) -> list[tuple[str, Any]]:
        """(URL, worker) of every worker in service behind a router still in the pool."""
        with self._lock:
            return [
                (url, w)
                for url, w in self._workers.items()
                if url not in self._out and self._router_of[url] in live_routers
            ]

    def serving_count(self, router: str) -> int:
        with self._lock:
            return sum(r == router and u not in self._out for u, r in self._router_of.items())

    def take_out(self, router: Any, urls: Collection[str], reason: str) -> list[str]:
        """Stop `router` routing to `urls` (its HTTP call raises on failure); the ones of them this
        pool knows, newly out."""
        router.remove_workers(set(urls))
        with self._lock:
            new = sorted(u for u in urls if u in self._workers and u not in self._out)
            self._out.update(dict.fromkeys(new, reason))
        return new

    def put_back(self, router: Any, url: str) -> None:
        """Route to `url` again (it now holds the learner's current version): once the router lists
        it, it is in service; raises (and stays out) when the router does not take it."""
        router.add_worker(self._workers[url])
        with self._lock:
            self._out.pop(url, None)

    def close_out(self) -> None:
        """Close the clients of the workers out of their router (the router closes its own)."""
        for url in self.out():
            self._workers[url].close()
