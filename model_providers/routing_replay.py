"""Rollout routing replay (R3) in the learner: the rollout engine's expert choices replace the
routers' own top-k on the tokens the engine routed.

megatron's `RouterReplay` hook (`moe_enable_routing_replay`) asks its router's `router_replay`
object for the top-k of every token (`moe_utils.topk_routing_with_score_function` calls
`get_replay_topk`); megatron's own object replays ALL tokens from one global list. Here each
`TorchGatingRouter` holds a `MergingReplay`, which takes given ids where a token has them and the
router's own top-k where it has none (-1: a prompt prefix the engine served from its prefix
cache, a sequence's last token, padding). The probabilities are the router's scores at the chosen
ids, so the aux loss and the z-loss still train the router, and the expert outputs are weighted by
the learner's own probabilities (slime's and verl's R3).

`replaying(model, routed_BTLK)` hands each router its layer's ids for one micro-batch, in the token
order of megatron's MoE layer: [s, b] flattened, sequence-major, each TP rank its own sequence chunk
under sequence parallelism (at every pipeline stage; a router knows its global layer by
`layer_number`), and takes them back afterwards.

Shape legend: b sequences, s positions (padded to a multiple of TP under sequence parallelism),
L layers (global), k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from megatron.core.utils import get_attr_wrapped_model, get_model_config

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class MergingReplay:
    """One router's replay: given ids [tokens, k] (-1 rows: not given) or None (route freely).
    `recorded`: the ids it chose in its last forward (replayed or its own), for measurements."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.recorded: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's hook: (probs, ids) [tokens, k] from scores [tokens, E]."""
        assert default_compute_topk is not None, "megatron passes its own top-k"
        probs, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            self.recorded = ids.detach()
            return probs, ids
        if self.target.shape != ids.shape:
            raise ValueError(
                f"replayed ids {tuple(self.target.shape)} for a router top-k of {tuple(ids.shape)}"
            )
        target = self.target.to(ids.device)
        ids = torch.where(target[:, :1] >= 0, target, ids)
        self.recorded = ids.detach()
        return scores.gather(1, ids), ids


def routers(model: torch.nn.Module) -> list[tuple[int, MergingReplay]]:
    """(global layer index, replay) of every router of this stage built for replay."""
    found = []
    for m in model.modules():
        replay = getattr(m, "router_replay", None)
        if isinstance(replay, MergingReplay):
            layer: int = m.layer_number  # type: ignore[assignment]  # megatron's, 1-based, global
            found.append((layer - 1, replay))
    return found


@contextmanager
def replaying(model: torch.nn.Module, routed_BTLK: torch.Tensor, padded_seq: int) -> Iterator[None]:
    """Replay `routed_BTLK` [b, s', L, k] (-1 where not routed; s' <= padded_seq, the rest is
    padding) in this stage's routers during one forward."""
    found = routers(model)
    if not found:
        raise ValueError(
            "routed experts were given, but the model's routers were not built for replay: "
            "set model.moe.routing_replay=true"
        )
    ids = routed_BTLK.to(torch.long)
    ids = torch.nn.functional.pad(ids, (0, 0, 0, 0, 0, padded_seq - ids.shape[1]), value=-1)
    ids = ids.transpose(0, 1)  # [s, b, L, k]: megatron's token order
    if get_model_config(model).sequence_parallel:
        tp = get_attr_wrapped_model(model, "pg_collection").tp
        ids = ids.tensor_split(tp.size(), dim=0)[tp.rank()]
    try:
        for layer, replay in found:
            replay.target = ids[:, :, layer].reshape(-1, ids.shape[-1])
        yield
    finally:
        for _, replay in found:
            replay.target = None
