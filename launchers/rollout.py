"""`srun ... python launchers/rollout.py --config C --server S --device D --port P`: one Slurm
rollout task (`sparserl_mcore.launch.rollout`) as a script path."""

import sys

from sparserl_mcore.launch.rollout import main

if __name__ == "__main__":
    sys.exit(main())
