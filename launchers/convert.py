"""`torchrun ... launchers/convert.py hf-to-mcore|mcore-to-hf ...`: the conversion rank entry
(`sparserl_mcore.launch.convert`) as a script path; `sparserl convert` adds the input checks."""

import sys

from sparserl_mcore.launch.convert import main

if __name__ == "__main__":
    from sparserl_mcore.parallel.rank_entry import rank_main

    sys.exit(rank_main(main))
