"""Checkpoints: the Megatron <-> HF layout (layout.py, the one owner of that mapping), HF
safetensors load/export (hf_io.py), Megatron dist checkpoints (dist_ckpt.py), the conversions and
the one HF export of a live model (convert.py), atomic output directories (atomic.py), tiny random
checkpoints (tiny.py), and the `sparserl convert` / `sparserl model` commands (cli.py with
verify_cli.py, model_cli.py).

Submodules are imported explicitly; this package imports nothing heavy. See docs/conversion.md.
"""
