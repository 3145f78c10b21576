"""`make bench`: run every benchmarks/bench_*.py module in turn (each prints its own table).

Pass module names to run a subset; arguments after a name go to that benchmark, e.g.
`python -m benchmarks bench_sync --lrs 3e-7 bench_rollout --repeats 11`.
"""

from __future__ import annotations

import importlib
import pathlib
import sys


def _plan(argv: list[str], known: list[str]) -> list[tuple[str, list[str]]]:
    """(benchmark, its arguments) in the order given; every benchmark with no arguments when empty."""
    if not argv:
        return [(name, []) for name in known]
    if argv[0] not in known:
        raise SystemExit(f"benchmarks: {argv[0]!r} is not a benchmark; known: {', '.join(known)}")
    plan: list[tuple[str, list[str]]] = []
    for token in argv:
        if token in known:
            plan.append((token, []))
        else:
            plan[-1][1].append(token)
    return plan


def main(argv: list[str]) -> int:
    known = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("bench_*.py"))
    failed = []
    for name, args in _plan(argv, known):
        print(f"\n=== benchmarks.{name} {' '.join(args)} ===", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        if module.main(args) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
