"""Rank entries: the `main(argv)` every torchrun / srun rank runs, one module per job.

- `train`: RL training (`sparserl train --nproc N`, the Slurm scripts via `launchers/train.py`);
- `convert`: HF <-> Megatron conversion, one shard per rank (`sparserl convert hf-to-mcore ...`);
- `verify`: megatron vs HF transformers logits (`sparserl convert verify`).

Each runs as `torchrun ... -m sparserl_mcore.launch.<name> ...`; the top-level `launchers/*.py`
are the same entries as script paths (the layout Megatron-LM and slime users know).
"""
