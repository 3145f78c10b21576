"""Rollout routing replay (R3) on the trainer side: the engines' expert ids into the batch.

With `model.moe.routing_replay` every request asks its engine for the experts it routed each token
to (`GenerateRequest.return_routed_experts`); `attach` lays them beside the tokens as
`routed_BTLK` [B, T, layers, top_k] in a compact dtype (int8 up to 128 experts, else int16), -1
where the engine routed nothing: a prompt prefix it served from its prefix cache, a sequence's
last token (never fed in), padding. The learner replays the ids in the pi_old recompute and the
policy forward (`model_providers.routing_replay`); -1 positions follow the learner's own router.

A sample whose payload does not fit it (missing, wrong rows or shape, ids outside the experts) is
refused: its loss mask is cleared, so it is not trained on, and it is counted. Telemetry per step:
`moe/replayed_tokens` and `moe/unreplayed_tokens` (fed positions [0, length - 1) of the rows
trained on, with and without ids), `moe/replay_refused_samples`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from sparserl_mcore.rollout.protocol import Sample
from sparserl_mcore.trainer.batch import RolloutBatch


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What an MoE policy's routed-expert payload holds per token."""

    layers: int
    top_k: int
    experts: int

    @classmethod
    def of_checkpoint(cls, hf_path: str | Path) -> RoutingShape | None:
        """From the checkpoint's config.json; None for a dense model."""
        from model_providers.hf_config import parse_hf_config

        hf = parse_hf_config(hf_path)
        return None if hf.moe is None else cls(hf.num_layers, hf.moe.top_k, hf.moe.num_experts)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.experts <= 128 else torch.int16


def payload_problem(sample: Sample, shape: RoutingShape) -> str | None:
    """Why `sample`'s routed experts cannot be replayed, or None."""
    x = sample.routed_experts
    if x is None:
        return "no routed experts returned"
    rows = max(0, sample.seqlen - 1) - sample.routed_experts_start
    if x.dim() != 3 or tuple(x.shape) != (rows, shape.layers, shape.top_k):
        return f"routed experts {tuple(x.shape)}, expected {(rows, shape.layers, shape.top_k)}"
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= shape.experts):
        return f"expert ids {int(x.min())}..{int(x.max())} outside [0, {shape.experts})"
    return None


def attach(
    batch: RolloutBatch, samples: Sequence[Sample], shape: RoutingShape
) -> tuple[RolloutBatch, dict[str, float], list[str]]:
    """The batch with `routed_BTLK` (rows in `samples` order, as `build_batch` lays them out) and
    the refused rows' masks cleared; the step's replay metrics; one line per refused sample."""
    if len(samples) != batch.size:
        raise ValueError(f"{len(samples)} samples for a batch of {batch.size} rows")
    B, T = batch.tokens_BT.shape
    routed = torch.full((B, T, shape.layers, shape.top_k), -1, dtype=shape.dtype)
    mask = batch.mask_BT.clone()
    refused: list[str] = []
    for row, sample in enumerate(samples):
        problem = payload_problem(sample, shape)
        if problem is not None:
            refused.append(f"sample {sample.rid}: {problem}; not trained on")
            mask[row] = 0.0
            continue
        assert sample.routed_experts is not None
        start = sample.routed_experts_start
        routed[row, start : start + sample.routed_experts.shape[0]] = sample.routed_experts.to(shape.dtype)
    fed = torch.arange(T)[None, :] < (batch.lengths_B - 1)[:, None]
    fed &= mask.sum(dim=1, keepdim=True) > 0  # rows trained on
    replayed = fed & (routed[:, :, 0, 0] >= 0)
    metrics = {
        "moe/replayed_tokens": float(replayed.sum()),
        "moe/unreplayed_tokens": float((fed & ~replayed).sum()),
        "moe/replay_refused_samples": float(len(refused)),
    }
    return dataclasses.replace(batch, mask_BT=mask, routed_BTLK=routed), metrics, refused
