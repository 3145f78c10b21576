"""`python tools/convert_checkpoint.py hf-to-mcore|mcore-to-hf|verify ...` = `sparserl convert ...`
(`sparserl_mcore.ckpt.cli`): HF <-> Megatron conversion and logit parity checks."""

import sys

from sparserl_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
