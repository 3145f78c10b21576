"""`make bench`: run every benchmarks/bench_*.py module in turn (each prints its own table).

Pass module names (e.g. `python -m benchmarks bench_sync`) to run a subset.
"""

from __future__ import annotations

import importlib
import pathlib
import sys


def main(argv: list[str]) -> int:
    here = pathlib.Path(__file__).parent
    names = argv or sorted(p.stem for p in here.glob("bench_*.py"))
    failed = []
    for name in names:
        print(f"\n=== benchmarks.{name} ===", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        if module.main([]) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
