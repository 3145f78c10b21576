"""Forward-only passes through megatron's pipeline schedules (no loss, no backward).

`forward_only` runs `get_forward_backward_func()` with `forward_only=True` over micro-batches of
token ids on every rank of a model-parallel group and applies `post_fn` to each micro-batch's
output on the last pipeline stage; the rest of the stages return []. `post_fn` receives the
TP-local (vocab-sharded) logits [b, s, V/TP] and the micro-batch, so log-prob recompute can reduce
them vocab-parallel without ever gathering the vocabulary. `forward_logits` is the verification
special case that gathers full-vocab logits. `run_schedule` is the shared call into the schedule
(pipeline communicator included) that the RL update's training pass uses as well.

Every stage must pass the same micro-batches (the first stage embeds them, the last one hands them to
`post_fn`); the schedule moves activations between stages itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

PostFn = Callable[[torch.Tensor, torch.Tensor], Any]


def _step(post_fn: PostFn, data_iterator, model):
    tokens = next(data_iterator)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None)

    def collect(logits: torch.Tensor, non_loss_data: bool = True) -> Any:
        return post_fn(logits, tokens)

    return output, collect


def forward_only(
    model: torch.nn.Module,
    micro_batches: Sequence[torch.Tensor],
    *,
    post_fn: PostFn,
    groups: ProcessGroupCollection,
) -> list[Any]:
    """Run the model forward over `micro_batches` (each [b, s] int64, equal shapes).

    Returns `[post_fn(logits_local, tokens) for each micro-batch]` on the last pipeline stage and
    [] on other stages. `groups` is `Runtime.groups`. Gradients are not recorded.
    """
    if not micro_batches:
        raise ValueError("forward_only needs at least one micro-batch")
    shapes = {tuple(mb.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must share one [batch, seq] shape, got {sorted(shapes)}")
    ((micro_batch_size, seq_length),) = shapes
    with torch.no_grad():
        return run_schedule(
            model,
            micro_batches,
            partial(_step, post_fn),
            groups=groups,
            micro_batch_size=micro_batch_size,
            seq_length=seq_length,
            forward_only=True,
            collect_non_loss_data=True,
        )


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    forward_step_func: Callable,
    *,
    groups: ProcessGroupCollection,
    micro_batch_size: int,
    seq_length: int,
    forward_only: bool,
    **schedule_kwargs: Any,
) -> list[Any]:
    """One pass of megatron's pipeline schedule for `groups.pp` (forward-only or training).

    The one place that picks the schedule and, with more than one stage, builds the P2P
    communicator from the (possibly DDP-wrapped) model's config.
    """
    pp_size = groups.pp.size()
    if pp_size > 1:
        schedule_kwargs["p2p_communicator"] = P2PCommunicator(
            pp_group=groups.pp, config=get_model_config(model)
        )
    return get_forward_backward_func(pp_size=pp_size)(
        forward_step_func=forward_step_func,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        pg_collection=groups,
        **schedule_kwargs,
    )


def gather_vocab(logits_local: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather vocab-sharded logits [..., V/TP] into [..., V] (verification only: V is large)."""
    if tp_group.size() == 1:
        return logits_local
    parts = [torch.empty_like(logits_local) for _ in range(tp_group.size())]
    dist.all_gather(parts, logits_local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    micro_batch_size: int,
    vocab_size: int,
    groups: ProcessGroupCollection,
) -> torch.Tensor | None:
    """Full-vocab fp32 logits [B, S, vocab_size] on the last stage (None on others).

    `input_ids` [B, S] is split into micro-batches of `micro_batch_size`; the padded vocabulary
    rows beyond `vocab_size` are dropped.
    """
    batch = input_ids.shape[0]
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch size {batch}")

    def full_logits(logits_local: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return gather_vocab(logits_local, groups.tp)[..., :vocab_size].float()

    outputs = forward_only(model, list(input_ids.split(micro_batch_size)), post_fn=full_logits, groups=groups)
    return torch.cat(outputs) if outputs else None
