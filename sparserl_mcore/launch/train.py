"""torchrun / srun entry for RL training: every rank runs `main`, which checks the run and trains
(`sparserl_mcore.trainer.cli`) inside `rank_main` (per-rank log, one-line errors, exit records); the
trainer reads its rank from the launcher's environment.

    torchrun --nproc_per_node N -m sparserl_mcore.launch.train --config X.yaml [key=value ...]
    torchrun --nproc_per_node N launchers/train.py --config X.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import sys

from sparserl_mcore.parallel.rank_entry import rank_main
from sparserl_mcore.trainer import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launchers/train.py", description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    return rank_main(lambda: cli.run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
