"""The learner's glue to the fused head + log-prob (loss/fused_logprob.py) under megatron-core.

`Head.of(model)` is the last stage's output layer as the fused Function needs it; `response_rows`
finds on the host which hidden-state rows the loss needs; `fused_token_logprobs` is
`megatron_step._token_logprobs` from hidden states instead of logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.utils import get_model_config
from torch import Tensor

from sparserl_mcore.loss.fused_logprob import linear_logprobs
from sparserl_mcore.parallel.forward import output_weight
from sparserl_mcore.parallel.runtime import Runtime


@dataclass(frozen=True)
class Head:
    """The last stage's output layer as the fused log-prob needs it (the flags its layer reads)."""

    weight: Tensor
    sequence_parallel: bool
    gradient_accumulation_fusion: bool

    @classmethod
    def of(cls, model) -> Head:
        config = get_model_config(model)
        return cls(output_weight(model), config.sequence_parallel, config.gradient_accumulation_fusion)


def response_rows(mask_BT: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """(rows of the flattened [s, b] hidden states, flat [b, T] positions they score) of the tokens in
    `mask_BT`, found on the host (a CPU mask: no device sync) and moved to `device`."""
    b, t = mask_BT.shape
    i, pos = mask_BT[:, 1:].cpu().bool().nonzero(as_tuple=True)
    return (pos * b + i).to(device, non_blocking=True), (i * t + pos + 1).to(device, non_blocking=True)


def fused_token_logprobs(
    hidden_SBH: Tensor,
    tokens_BT: Tensor,
    rows: tuple[Tensor, Tensor] | None,
    *,
    head: Head,
    runtime: Runtime,
    temperature: float,
    vocab_size: int | None,
) -> tuple[Tensor, Tensor]:
    """`_token_logprobs` from the final hidden states [s, b, H] through the fused head; `rows` from
    `response_rows` (0 elsewhere), None for every position 1..T-1."""
    s, b, h = hidden_SBH.shape
    if rows is None:
        hidden, target = hidden_SBH[:-1].reshape(-1, h), tokens_BT[:, 1:].t().reshape(-1)
    else:
        hidden = hidden_SBH.reshape(s * b, h).index_select(0, rows[0])
        target = tokens_BT.reshape(-1).index_select(0, rows[1])
    logp, ent = linear_logprobs(
        hidden,
        head.weight,
        target,
        group=runtime.groups.tp,
        vocab_start=runtime.tp_rank * head.weight.shape[0],
        vocab_size=vocab_size,
        temperature=temperature,
        reduce_dgrad=not head.sequence_parallel,  # the sequence gather's backward reduces it then
        gradient_accumulation_fusion=head.gradient_accumulation_fusion,
    )
    if rows is None:
        pad = (1, 0)
        return (
            torch.nn.functional.pad(logp.view(s - 1, b).t(), pad),
            torch.nn.functional.pad(ent.view(s - 1, b).t(), pad),
        )
    zeros = logp.new_zeros(b * s)
    return zeros.index_copy(0, rows[1], logp).view(b, s), zeros.index_copy(0, rows[1], ent).view(b, s)
