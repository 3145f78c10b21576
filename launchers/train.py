"""`torchrun ... launchers/train.py --config X.yaml [key=value ...]`: the RL training rank entry
(`sparserl_mcore.launch.train`) as a script path, for torchrun/srun command lines and Slurm."""

import sys

from sparserl_mcore.launch.train import main

if __name__ == "__main__":
    sys.exit(main())
