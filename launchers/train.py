"""torchrun / srun entry for RL training: `torchrun ... launchers/train.py --config X.yaml [k=v ...]`.

Every rank runs this; the trainer reads its rank from the launcher's environment.
"""

from __future__ import annotations

import sys

from sparserl_mcore.trainer.cli import rank_entry

if __name__ == "__main__":
    sys.exit(rank_entry())
