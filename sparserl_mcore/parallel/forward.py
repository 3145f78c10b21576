"""Forward-only passes through megatron's pipeline schedules (no loss, no backward).

`forward_only` runs `get_forward_backward_func()` with `forward_only=True` over micro-batches of
token ids on every rank of a model-parallel group and applies `post_fn` to each micro-batch's
output on the last pipeline stage; the rest of the stages return []. `post_fn` receives the
TP-local (vocab-sharded) logits [b, s, V/TP] and the micro-batch, so log-prob recompute can reduce
them vocab-parallel without ever gathering the vocabulary. `forward_logits` is the verification
special case that gathers full-vocab logits. `hidden_forward` is `model_forward` without the output
layer on the last stage, for the fused head + log-prob (loss/fused_logprob.py). `run_schedule` is
the shared call into the schedule (pipeline communicator included) that the RL update's training
pass uses as well.

Every stage must pass the same micro-batches (the first stage embeds them, the last one hands them to
`post_fn`); the schedule moves activations between stages itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from model_providers.routing_replay import replaying

PostFn = Callable[[torch.Tensor, torch.Tensor], Any]


def sequence_parallel_tokens(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` [b, s] right-padded (with token 0) to a multiple of TP when the model runs with
    sequence parallelism (megatron's MoE layers need it at TP > 1), which splits the sequence
    over the TP ranks. Causal attention keeps the first s positions' outputs exact; callers cut
    the logits back to s (`model_forward`)."""
    config = get_model_config(model)
    tp = config.tensor_model_parallel_size
    pad = -tokens.shape[1] % tp if config.sequence_parallel else 0
    return torch.nn.functional.pad(tokens, (0, pad)) if pad else tokens


def padding_mask(tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """[b, s] bool, True on right padding (position >= the row's length): megatron's convention."""
    positions = torch.arange(tokens_BT.shape[1], device=lengths_B.device)
    return positions[None, :] >= lengths_B[:, None]


def model_forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    padding_BT: torch.Tensor | None = None,
    routed_BTLK: torch.Tensor | None = None,
) -> tuple[Any, Callable[[Any], Any]]:
    """The GPT forward of one micro-batch of token ids [b, s] (positions 0..s-1, causal mask):
    (megatron's output, a function cutting its logits back to s positions). The one place a
    micro-batch enters the model, for forward-only passes and for the training pass.

    `padding_BT` (True on padding) reaches megatron's MoE routers, which then leave padding out of
    the aux loss, the z-loss and their token counts; causal attention already keeps it out of
    every real token's output. Dense models ignore it.

    `routed_BTLK` [b, s, layers, k] (the rollout engine's expert ids, -1 where it routed none):
    the MoE routers replay them (rollout routing replay, `model_providers.routing_replay`)."""
    seq = tokens.shape[1]
    tokens = sequence_parallel_tokens(model, tokens)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    replay = nullcontext() if routed_BTLK is None else replaying(model, routed_BTLK, tokens.shape[1])
    with replay:
        if padding_BT is None or get_model_config(model).num_moe_experts is None:
            output = model(tokens, position_ids, None)
        else:
            output = model(
                tokens, position_ids, None, padding_mask=_stage_padding(model, padding_BT, tokens.shape[1])
            )
    return output, lambda logits: logits[:, :seq]


def _stage_padding(model: torch.nn.Module, padding_BT: torch.Tensor, padded_seq: int) -> torch.Tensor:
    """The padding mask as this stage's MoE layers read it: the sequence-parallel pad positions
    are padding too; megatron splits the mask over TP itself on the first stage only, so later
    stages get their own sequence chunk here."""
    padding_BT = torch.nn.functional.pad(padding_BT, (0, padded_seq - padding_BT.shape[1]), value=True)
    config = get_model_config(model)
    if not config.sequence_parallel or get_attr_wrapped_model(model, "pre_process"):
        return padding_BT
    tp = get_attr_wrapped_model(model, "pg_collection").tp
    return padding_BT.tensor_split(tp.size(), dim=1)[tp.rank()]


def _gpt(model: torch.nn.Module) -> Any:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def hidden_forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    padding_BT: torch.Tensor | None = None,
    routed_BTLK: torch.Tensor | None = None,
) -> tuple[Any, Callable[[Any], Any]]:
    """`model_forward`, except that the last stage returns the decoder's final hidden states
    [s, b, H] (after the final norm) instead of logits: the embedding / decoder calls of
    GPTModel.forward without its output layer. The returned function cuts them to the
    micro-batch's s positions, gathering the sequence first under sequence parallelism (megatron's
    gather, whose backward reduce-scatters the partial d_hidden as the output layer's would).
    Other stages: exactly `model_forward`. Not for multi-token prediction (refused). `padding_BT`,
    `routed_BTLK`: as `model_forward`'s."""
    gpt = _gpt(model)
    if not gpt.post_process:
        return model_forward(model, tokens, padding_BT=padding_BT, routed_BTLK=routed_BTLK)
    if gpt.config.mtp_num_layers:
        raise ValueError("the fused log-prob head does not support multi-token prediction (mtp_num_layers)")
    seq = tokens.shape[1]
    tokens = sequence_parallel_tokens(model, tokens)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    padding = None
    if padding_BT is not None and gpt.config.num_moe_experts is not None:
        padding = _stage_padding(model, padding_BT, tokens.shape[1])
    pre = gpt._preprocess(input_ids=tokens, position_ids=position_ids, padding_mask=padding)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = pre[:6]
    replay = nullcontext() if routed_BTLK is None else replaying(model, routed_BTLK, tokens.shape[1])
    with replay:
        hidden = gpt.decoder(
            hidden_states=decoder_input,
            attention_mask=None,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=pre[6] if len(pre) == 7 else None,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
        )

    # the output layer's forward is skipped: run its forward pre-hooks (megatron DDP's wait for the
    # all-gather of its parameters under overlap_param_gather) where its forward would run
    for hook in list(gpt.output_layer._forward_pre_hooks.values()):
        hook(gpt.output_layer, (hidden,))

    def cut(h: torch.Tensor) -> torch.Tensor:
        if gpt.config.sequence_parallel:
            h = gather_from_sequence_parallel_region(
                h, tensor_parallel_output_grad=True, group=gpt.pg_collection.tp
            )
        return h[:seq]

    return hidden, cut


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The last stage's [V/TP, H] head weight: the output layer's, or the shared embedding when tied."""
    gpt = _gpt(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _step(post_fn: PostFn, forward: Callable, data_iterator, model):
    item = next(data_iterator)
    tokens, routed = item if isinstance(item, tuple) else (item, None)
    output, cut = forward(model, tokens, routed_BTLK=routed)

    def collect(logits: torch.Tensor, non_loss_data: bool = True) -> Any:
        return post_fn(cut(logits), tokens)

    return output, collect


def forward_only(
    model: torch.nn.Module,
    micro_batches: Sequence[torch.Tensor],
    *,
    post_fn: PostFn,
    groups: ProcessGroupCollection,
    forward: Callable = model_forward,
    routed_experts: Sequence[torch.Tensor] | None = None,
) -> list[Any]:
    """Run the model forward over `micro_batches` (each [b, s] int64, equal shapes).

    Returns `[post_fn(logits_local, tokens) for each micro-batch]` on the last pipeline stage and
    [] on other stages. `groups` is `Runtime.groups`. Gradients are not recorded. `forward`:
    `model_forward`, or `hidden_forward` (post_fn then gets the final hidden states [s, b, H]).
    `routed_experts`: per micro-batch, the expert ids its MoE routers replay (`model_forward`).
    """
    if not micro_batches:
        raise ValueError("forward_only needs at least one micro-batch")
    shapes = {tuple(mb.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must share one [batch, seq] shape, got {sorted(shapes)}")
    ((micro_batch_size, seq_length),) = shapes
    items: Sequence[Any] = micro_batches
    if routed_experts is not None:
        items = list(zip(micro_batches, routed_experts, strict=True))
    with torch.no_grad():
        return run_schedule(
            model,
            items,
            partial(_step, post_fn, forward),
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
    communicator from the (possibly DDP-wrapped) model's config. `seq_length` is the micro-batches'
    own; the stages exchange activations of the padded length `model_forward` runs.
    """
    config = get_model_config(model)
    if config.sequence_parallel:
        seq_length += -seq_length % config.tensor_model_parallel_size
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
