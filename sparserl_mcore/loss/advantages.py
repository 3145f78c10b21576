"""GRPO group-normalised advantages."""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sequence advantage (R - mean_group) / (std_group + eps).

    Args:
        rewards: [num_prompts * group_size], the samples of one prompt consecutive.
        group_size: samples per prompt (>= 2: one sample has no baseline).
        normalize_std: divide by the group std (Bessel-corrected, as torch.std and GRPO reference
            code do); False keeps only the mean baseline (Dr. GRPO).
        eps: keeps groups whose rewards are all equal at advantage 0 instead of 0/0.

    Returns:
        [num_prompts * group_size] float32; `broadcast_to_tokens` expands it to [batch, seq].
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO needs at least 2 samples per prompt")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            "pass every sample of every prompt"
        )
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    grouped = rewards.to(torch.float32).view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """[batch] sequence advantages -> [batch, seq], zero outside the mask."""
    if advantages.dim() != 1 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} does not match mask batch {mask.shape[0]}"
        )
    return advantages[:, None].to(torch.float32) * mask.to(torch.float32)
