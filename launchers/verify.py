"""`torchrun ... launchers/verify.py --hf-dir H --mcore-dir M --tp T --pp P --result R`: the
logit-parity rank entry (`sparserl_mcore.launch.verify`) as a script path."""

import sys

from sparserl_mcore.launch.verify import main

if __name__ == "__main__":
    from sparserl_mcore.parallel.rank_entry import rank_main

    sys.exit(rank_main(main))
