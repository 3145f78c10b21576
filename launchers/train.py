"""torchrun / srun entry for RL training: `torchrun ... launchers/train.py --config X.yaml [k=v ...]`.

Every rank runs this; the trainer reads its rank from the launcher's environment.
"""

from __future__ import annotations

import argparse
import sys

from sparserl_mcore.trainer import cli

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="launchers/train.py", description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    sys.exit(cli.run(parser.parse_args()))
