"""Checkpoints: the Megatron <-> HF layout (layout.py, the one owner of that mapping), HF
safetensors load/export (hf_io.py), Megatron dist checkpoints (dist_ckpt.py), the conversions
(convert.py), atomic output directories (atomic.py) and tiny random checkpoints (tiny.py).

Submodules are imported explicitly; this package imports nothing heavy. See docs/conversion.md.
"""
