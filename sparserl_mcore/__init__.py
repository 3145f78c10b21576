"""sparserl-mcore: Megatron-core RL post-training with sparse rollouts, DGG and sparse weight sync."""

__version__ = "0.1.0"
