"""`python tools/make_tiny.py --arch qwen2 --out DIR ...` = `sparserl model make-tiny ...`
(`sparserl_mcore.ckpt.model_cli`): a tiny random-weight HF checkpoint, offline."""

import sys

from sparserl_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["model", "make-tiny", *sys.argv[1:]]))
