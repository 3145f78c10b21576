"""Routing telemetry of a mixture-of-experts learner: what the routers did in one step's update.

Each router (`model_providers.moe.TorchGatingRouter`) counts, in training passes, the
token-to-expert assignments of its rank's tokens and the load-balancing loss of each micro-batch.
`collect` sums them over the ranks of a pipeline stage (every rank routes its own tokens: its
data-parallel share and, under sequence parallelism, its slice of the sequence; each TP rank's
loss is its tokens' part of the micro-batch's), joins the stages
over PP and returns, on every rank, a `RoutingStats` with the full [layers, experts] table:

- `moe/load_imbalance`: the mean over layers of max_e(tokens_e) / mean_e(tokens_e) (1: balanced;
  E / top_k: every token of a layer goes to the same experts); `moe/load_imbalance_max`: the worst
  layer; `moe/expert_load_min`: the least-used expert's share relative to the mean (0: an expert
  that received nothing this step);
- `moe/aux_loss`: the load-balancing loss (without its coefficient; megatron's logging
  convention), averaged over layers and micro-batches, when one is trained.

The full table goes to `<telemetry.dir>/moe_routing.jsonl` (`append_table`), one line per step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from model_providers.moe import TorchGatingRouter
from sparserl_mcore.parallel.runtime import Runtime

TABLE_FILE = "moe_routing.jsonl"


@dataclass(frozen=True)
class RoutingStats:
    """One step's routing: tokens_per_expert [layers, experts]; aux_loss [layers] (NaN: none)."""

    tokens_per_expert: np.ndarray
    aux_loss: np.ndarray

    def metrics(self) -> dict[str, float]:
        counts = self.tokens_per_expert.astype(np.float64)
        mean = counts.mean(axis=1)
        used = mean > 0
        if not used.any():
            return {}
        imbalance = counts.max(axis=1)[used] / mean[used]
        out = {
            "moe/load_imbalance": float(imbalance.mean()),
            "moe/load_imbalance_max": float(imbalance.max()),
            "moe/expert_load_min": float((counts.min(axis=1)[used] / mean[used]).min()),
        }
        if not np.isnan(self.aux_loss).all():
            out["moe/aux_loss"] = float(np.nanmean(self.aux_loss))
        return out


def routers(model: torch.nn.Module) -> list[TorchGatingRouter]:
    """The MoE routers of a (DDP-wrapped) model stage, in layer order."""
    return [m for m in model.modules() if isinstance(m, TorchGatingRouter)]


def collect(model: torch.nn.Module, runtime: Runtime) -> RoutingStats | None:
    """Collective over the learner's ranks: the routing since the last call (None: a dense model).

    Counts are summed over the stage (`groups.tp_dp_cp`: disjoint tokens on every rank), the aux
    loss averaged over the micro-batches of the stage's ranks, the stages joined over `groups.pp`.
    """
    found = routers(model)
    if not found:
        return None
    taken = [r.take_stats() for r in found]
    counts = torch.stack([c for c, _ in taken])
    aux = torch.stack([a for _, a in taken])
    stage = runtime.groups.tp_dp_cp
    dist.all_reduce(counts, group=stage)
    dist.all_reduce(aux, group=stage)
    # each TP x CP rank holds its tokens' part of a micro-batch's loss (megatron sums them for
    # its logs): the sum over the stage is right, the micro-batch count TP x CP times too many
    aux[:, 1] /= runtime.tp_size * runtime.cp_size
    layers = [r.layer_number - 1 for r in found]  # megatron numbers layers from 1, globally
    part = (layers, counts.cpu().numpy(), aux.cpu().numpy())
    parts: list[Any] = [part]
    if runtime.pp_size > 1:
        parts = [None] * runtime.pp_size
        dist.all_gather_object(parts, part, group=runtime.groups.pp)
    total = sum(len(p[0]) for p in parts)
    table = np.zeros((total, counts.shape[1]), dtype=np.int64)
    aux_loss = np.full(total, np.nan)
    for layer_ids, layer_counts, layer_aux in parts:
        table[layer_ids] = layer_counts
        has = layer_aux[:, 1] > 0
        aux_loss[np.asarray(layer_ids)[has]] = layer_aux[has, 0] / layer_aux[has, 1]
    return RoutingStats(tokens_per_expert=table, aux_loss=aux_loss)


def append_table(telemetry_dir: str | Path, step: int, stats: RoutingStats) -> None:
    """One line of `moe_routing.jsonl`: the step's tokens per expert and aux loss, per layer."""
    path = Path(telemetry_dir) / TABLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    aux = [None if np.isnan(v) else float(v) for v in stats.aux_loss]
    line = {"step": step, "tokens_per_expert": stats.tokens_per_expert.tolist(), "aux_loss": aux}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
