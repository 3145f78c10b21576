"""Sparse BF16 sync vs dense safetensors on real Adam steps (`sparserl sync bench`).

`python -m benchmarks bench_sync` runs the quick shape; `python -m benchmarks.bench_sync --full`
runs the Qwen2.5-0.5B shape (~10 GB RAM). Results: docs/benchmarks.md, "Sparse sync".
"""

from __future__ import annotations

import argparse
import sys

from sparserl_mcore.sync import cli


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_sync", description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(["bench", *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
