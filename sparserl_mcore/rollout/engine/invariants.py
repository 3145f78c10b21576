"""Resource invariants of the scheduler: every page reference and compression lane has an owner.

Checked when the scheduler falls idle (cheap: O(pages + requests)), and after every step when
`EngineConfig.check_invariants` is set (the tests do). A violation means a leak or a double
release: the engine reports it through its health and the tests fail on it.

- Pages: the reference count of every page equals the number of holders (each request whose
  page table lists it, the radix tree when it caches it, the pool for its reserved pages); the
  free list holds exactly the pages nobody holds, each once. So free + held == capacity.
- Lanes: the free lanes plus the lanes of running requests are all lanes, each exactly once;
  every running request holds one (when lanes exist), no waiting or finished request does.
- Requests: none is both waiting and running; none of them is finished.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from sparserl_mcore.rollout.engine.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.radix_cache import RadixCache
from sparserl_mcore.rollout.engine.request_state import RequestState


def resource_problems(
    pool: KVPool,
    radix: RadixCache | None,
    lanes: CompressionLanes | None,
    running: Sequence[RequestState],
    waiting: Iterable[RequestState],
) -> list[str]:
    """Every violated invariant, one line each (empty when all hold)."""
    waiting = list(waiting)
    problems = _request_problems(running, waiting)
    problems += _page_problems(pool, radix, [*running, *waiting])
    if lanes is not None:
        problems += _lane_problems(lanes, running, waiting)
    return problems


def _request_problems(running: Sequence[RequestState], waiting: list[RequestState]) -> list[str]:
    out = []
    both = {id(r) for r in running} & {id(r) for r in waiting}
    if both:
        out.append(f"{len(both)} requests are both running and waiting")
    done = [r.rid for r in [*running, *waiting] if r.done]
    if done:
        out.append(f"finished requests still queued or running: {done[:3]}")
    return out


def _page_problems(pool: KVPool, radix: RadixCache | None, requests: list[RequestState]) -> list[str]:
    holders: Counter[int] = Counter()
    for r in requests:
        holders.update(r.pages)
    tree_pages = list(radix.cached_pages()) if radix is not None else []
    holders.update(tree_pages)
    holders.update(pool.reserved)
    out = []
    if radix is not None and len(tree_pages) != radix.num_pages:
        out.append(f"radix tree holds {len(tree_pages)} pages but counts {radix.num_pages}")
    wrong = [p for p in range(pool.num_pages) if pool.refs[p] != holders[p]]
    if wrong:
        p = wrong[0]
        out.append(
            f"{len(wrong)} pages have a reference count unlike their holders (page {p}: "
            f"{pool.refs[p]} references, {holders[p]} holders)"
        )
    free = pool.free_pages
    if len(set(free)) != len(free):
        out.append("a page is on the free list twice")
    held = sum(1 for p in range(pool.num_pages) if holders[p])
    if len(set(free)) + held != pool.num_pages or any(holders[p] for p in free):
        out.append(f"free pages {len(set(free))} + held pages {held} != capacity {pool.num_pages}")
    return out


def _lane_problems(
    lanes: CompressionLanes, running: Sequence[RequestState], waiting: list[RequestState]
) -> list[str]:
    out = []
    held = [r.lane for r in running if r.lane is not None]
    if len(held) != len(running):
        out.append(f"{len(running) - len(held)} running requests hold no compression lane")
    stray = [r.rid for r in waiting if r.lane is not None]
    if stray:
        out.append(f"waiting requests hold compression lanes: {stray[:3]}")
    free = lanes.free_lanes
    everyone = [*free, *held]
    if len(set(everyone)) != len(everyone) or len(everyone) != lanes.num_lanes:
        out.append(
            f"free lanes {len(free)} + held lanes {len(held)} != {lanes.num_lanes} lanes (or one is "
            "counted twice)"
        )
    return out
