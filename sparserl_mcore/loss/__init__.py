"""RL loss: GRPO advantages, Sparse-RL correction, decoupled PPO, vocab-parallel log-probs, DGG.

The names here are pure torch (no megatron import). The megatron-core training step lives in
`sparserl_mcore.loss.megatron_step` (imported on its own). API reference: docs/loss.md.
"""

from sparserl_mcore.loss.advantages import broadcast_to_tokens, grpo_advantages
from sparserl_mcore.loss.correction import CorrectionConfig, CorrectionTotals, sparse_rl_correction
from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate, GateDecision
from sparserl_mcore.loss.policy import PolicyLossConfig, policy_loss
from sparserl_mcore.loss.totals import LossTotals, reduce_metrics
from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs

__all__ = [
    "CorrectionConfig",
    "CorrectionTotals",
    "DGGConfig",
    "DynamicGradientGate",
    "GateDecision",
    "LossTotals",
    "PolicyLossConfig",
    "broadcast_to_tokens",
    "grpo_advantages",
    "policy_loss",
    "reduce_metrics",
    "sparse_rl_correction",
    "vocab_parallel_logprobs",
]
