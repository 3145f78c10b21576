"""The outer step across islands: DiLoCo (dense) or PULSELoCo (sparse, error feedback).

Each rank keeps, for the FP32 master range its optimizer owns (`shards.MainShards`), the anchor
(the last agreed weights), the outer momentum and, in `pulse` mode, the residual: 12 bytes per
owned element on the device of the master weights. The inner optimizer (megatron's Adam, its
moments included) runs untouched; every `inner_steps` applied updates (`after_inner_step`, called
by `IslandOptimizer` after megatron's step) each rank:

1. reads its masters w and forms delta = anchor - w (the island's pseudo-gradient);
2. dense: all-reduces delta over the cross-island group (the same range on every island);
   pulse: runs `gate.pulse_gate` (send s = e + delta where bf16(anchor) would change, keep the
   rest in e), codes the entries against the anchor (`payload`), all-gathers the payloads over the
   cross-island group and adds them up in island order (every island the same sum, bit for bit);
3. divides by the island count, takes one Nesterov SGD step on the anchor with it (torch's SGD
   arithmetic: buf = m * buf + g; anchor -= lr * (g + m * buf)), writes the anchor into the
   masters and publishes them (BF16 casts, the island's param all-gather);
4. checks agreement: per tensor an xxh3-64 of the anchor range and of the model weights, gathered
   over the cross-island group; a difference stops every rank with one line naming the tensor and
   the ranks (`IslandsDiverged`). The same check runs once at construction (same start weights).

In `pulse` mode step 2 already checks the anchors the islands start from: each payload carries a
digest of bf16(anchor) per owned range, so a receiver whose anchor differs names the tensor
("islands diverged before outer step k: the FP32 anchor of ..."), and a payload damaged on the
way (checksum) is reported as such (`OuterStepFailed`). A rank that finds a problem goes on with
the step (ending alone would leave the others waiting in the next collective) and every rank
raises the same line in step 4.

The only traffic between islands is step 2 and the small hashes / counters of step 4, every H
steps; the control flags the learner already agrees on per update (skip a non-finite update, the
DGG gate) keep every island's step count equal (`IslandOptimizer.prepare_grads`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch import Tensor

from sparserl_mcore.diloco import payload
from sparserl_mcore.diloco.config import DiLoCoConfig
from sparserl_mcore.diloco.gate import bf16_bits, pulse_gate
from sparserl_mcore.diloco.shards import MainShards

Gate = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
_MASK63 = 2**63 - 1


class OuterStepFailed(RuntimeError):
    """The outer step cannot go on (a payload from another island is unusable); every rank of the
    learner raises it with the same one line."""


class IslandsDiverged(OuterStepFailed):
    """Islands hold different anchors or weights: at the start, going into an outer step, or
    after it."""


def all_gather_bytes(blob: bytes, group: dist.ProcessGroup, device: torch.device) -> list[bytes]:
    """Every member's `blob`, in group rank order (sizes first, then one padded all-gather)."""
    n = dist.get_world_size(group)
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(out, mine.to(device), group=group)
    return [o[:k].cpu().numpy().tobytes() for o, k in zip(out, lengths, strict=True)]


def _hash(t: Tensor) -> int:
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return xxhash.xxh3_64_intdigest(data) & _MASK63


class OuterStep:
    """DiLoCo / PULSELoCo state and step for this rank's master range (see the module docstring).

    Collective at construction (layout and start-weight checks) and in every outer step: every rank
    of the learner calls `after_inner_step` after each applied update, in the same order.
    """

    def __init__(
        self,
        shards: MainShards,
        cfg: DiLoCoConfig,
        *,
        island: int,
        islands: int,
        cross_group: dist.ProcessGroup,
        learner_group: dist.ProcessGroup,
        gate: Gate = pulse_gate,
    ) -> None:
        self.shards, self.cfg, self.gate = shards, cfg, gate
        self.island, self.islands = island, islands
        self.cross, self.learner = cross_group, learner_group
        self.cross_ranks = dist.get_process_group_ranks(cross_group)
        self.spans = [s.end - s.start for s in shards.shards]  # the payload's anchor-check ranges
        self.device = shards.device
        self.anchor = shards.read()
        zeros = torch.zeros_like(self.anchor)
        self.residual = zeros.clone() if cfg.mode == "pulse" else None
        self.momentum = zeros if cfg.outer_momentum > 0 else None
        self.inner = 0  # applied inner steps since the last outer step
        self.outer_steps = 0
        self.totals = {"payload_bytes": 0.0, "dense_bytes": 0.0, "sent": 0.0, "inner_steps": 0.0}
        self.records: list[dict[str, float]] = []  # one per outer step, until `pop_records`
        self._check_layout()
        self._verify(self._digests(), "at the start (every island must load the same weights)")

    # -- the step ----------------------------------------------------------------------------
    def after_inner_step(self) -> None:
        """Count one applied inner update; the H-th runs the outer step (at once, if a resume with
        a smaller H finds the round already longer)."""
        self.inner += 1
        self.totals["inner_steps"] += 1
        if self.inner >= self.cfg.inner_steps:
            self.step()

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """One outer step now (collective); returns its metrics (also kept for `pop_records`)."""
        delta = self.shards.read()
        torch.sub(self.anchor, delta, out=delta)
        delta_sq = float(delta.double().square().sum())
        problem = None  # a payload this rank could not decode: reported with the hash check
        if self.residual is None:
            dist.all_reduce(delta, group=self.cross)
            total, sent, size = delta, self.anchor.numel(), 4 * self.anchor.numel()
        else:
            total, sent, size, problem = self._pulse_exchange(delta)
        total.div_(self.islands)
        self._outer_sgd(total)
        self.shards.write(self.anchor)
        self.shards.publish()
        self.inner = 0
        self.outer_steps += 1
        residual_sq = float(self.residual.double().square().sum()) if self.residual is not None else 0.0
        local = [sent, self.anchor.numel(), size, residual_sq, delta_sq]
        record = self._verify(self._digests(), f"after outer step {self.outer_steps}", local, problem)
        self.records.append(record)
        return record

    def _pulse_exchange(self, delta: Tensor) -> tuple[Tensor, int, int, OuterStepFailed | None]:
        """(sum over islands of the sent entries, this rank's sent count, its payload bytes, why a
        payload could not be used). A bad payload must not end this rank alone (the others would
        wait in the next collective): it is reported by `_verify` on every rank."""
        assert self.residual is not None
        idx, values = self.gate(self.anchor, delta, self.residual)
        base = bf16_bits(self.anchor).cpu().numpy().view(np.uint16)
        blob = payload.encode(
            idx.cpu().numpy(), values.cpu().numpy(), base, spans=self.spans, level=self.cfg.zstd_level
        )
        blobs = all_gather_bytes(blob, self.cross, self.device)
        total, problem = delta.zero_(), None
        for island, theirs in enumerate(blobs):  # island order: the same sum on every island
            if island == self.island:
                total.index_add_(0, idx, values)
                continue
            try:
                i, v = payload.decode(theirs, base, spans=self.spans)
            except payload.PayloadError as exc:
                problem = problem or self._unusable(island, exc)
                continue
            total.index_add_(0, torch.from_numpy(i).to(self.device), torch.from_numpy(v).to(self.device))
        return total, int(idx.numel()), len(blob), problem

    def _unusable(self, island: int, exc: payload.PayloadError) -> OuterStepFailed:
        """What this rank reports about `island`'s payload: the tensor whose anchor differs, or the
        payload's own fault."""
        step = self.outer_steps + 1
        if isinstance(exc, payload.BaseMismatch):
            differs = f"the FP32 anchor of {self.shards.shards[exc.span].name} differs"
            return IslandsDiverged(
                f"islands diverged before outer step {step}: {differs} {self._between(self.island, island)}"
            )
        return OuterStepFailed(
            f"outer step {step}: rank {self.cross_ranks[self.island]} (island {self.island}) cannot use "
            f"the payload of rank {self.cross_ranks[island]} (island {island}): {exc}"
        )

    def _outer_sgd(self, grad: Tensor) -> None:
        """torch.optim.SGD's arithmetic (momentum, dampening 0, Nesterov) on the anchor."""
        m, update = self.cfg.outer_momentum, grad
        if self.momentum is not None:
            self.momentum.mul_(m).add_(grad)
            update = grad.add(self.momentum, alpha=m) if self.cfg.nesterov else self.momentum
        self.anchor.add_(update, alpha=-self.cfg.outer_lr)

    # -- agreement ---------------------------------------------------------------------------
    def _check_layout(self) -> None:
        mine = torch.tensor([self.shards.fingerprint(), self.anchor.numel()], dtype=torch.int64)
        seen = [torch.zeros_like(mine) for _ in self.cross_ranks]
        dist.all_gather(seen, mine.to(self.device), group=self.cross)
        if any(not torch.equal(s.cpu(), mine) for s in seen):
            raise IslandsDiverged(
                f"ranks {self.cross_ranks} (the same place in each island) own different master "
                "ranges: every island must use the same model, layout and optimizer settings"
            )

    def _digests(self) -> tuple[list[str], Tensor]:
        """(what differs, int64 hashes): each owned anchor range, then each model weight of this
        rank."""
        labels, values = [], []
        for s in self.shards.shards:
            labels.append(f"the FP32 anchor of {s.name} differs")
            values.append(_hash(self.anchor[s.offset : s.offset + s.end - s.start]))
        for name, param in self.shards.params:
            labels.append(f"the {str(param.dtype).removeprefix('torch.')} weights of {name} differ")
            values.append(_hash(param))
        return labels, torch.tensor(values, dtype=torch.int64)

    def _verify(
        self,
        digests: tuple[list[str], Tensor],
        when: str,
        local: list[float] | None = None,
        problem: OuterStepFailed | None = None,
    ) -> dict[str, float]:
        """Collective: raise IslandsDiverged on every rank if any cross-island group disagrees (or
        the first `problem` a rank reports, with its type); returns the outer step's metrics summed
        over every rank of every island."""
        labels, mine = digests
        seen = [torch.zeros_like(mine, device=self.device) for _ in self.cross_ranks]
        dist.all_gather(seen, mine.to(self.device), group=self.cross)
        problem = problem or self._first_difference(labels, [s.cpu() for s in seen], when)
        sums = torch.tensor([float(problem is not None), *(local or [0.0] * 5)], dtype=torch.float64)
        sums = sums.to(self.device)
        dist.all_reduce(sums, group=self.learner)
        if sums[0] > 0:  # the first report in learner rank order: the same line on every rank
            found: list[tuple[str, str] | None] = [None] * dist.get_world_size(self.learner)
            report = (type(problem).__name__, str(problem)) if problem is not None else None
            dist.all_gather_object(found, report, group=self.learner)
            kind, line = next(f for f in found if f)
            raise (IslandsDiverged if kind == IslandsDiverged.__name__ else OuterStepFailed)(line)
        return self._record(sums.tolist()[1:])

    def _first_difference(self, labels: list[str], seen: list[Tensor], when: str) -> IslandsDiverged | None:
        """One line naming the first tensor whose hash differs from island 0's, and the ranks."""
        for i, theirs in enumerate(seen[1:], start=1):
            differ = (theirs != seen[0]).nonzero()
            if differ.numel():
                return IslandsDiverged(
                    f"islands diverged {when}: {labels[int(differ[0])]} {self._between(0, i)}"
                )
        return None

    def _between(self, a: int, b: int) -> str:
        """'between rank R (island I) and ...', the lower island first (the same words from both)."""
        a, b = sorted((a, b))
        return f"between rank {self.cross_ranks[a]} (island {a}) and rank {self.cross_ranks[b]} (island {b})"

    def _record(self, sums: list[float]) -> dict[str, float]:
        sent, numel, size, residual_sq, delta_sq = sums
        dense = 4.0 * numel
        for key, value in (("payload_bytes", size), ("dense_bytes", dense), ("sent", sent)):
            self.totals[key] += value
        return {
            "diloco/outer_step": float(self.outer_steps),
            "diloco/density": sent / max(numel, 1.0),
            "diloco/sent": sent,
            "diloco/payload_bytes": size,
            "diloco/dense_bytes": dense,
            "diloco/bytes_per_entry": size / max(sent, 1.0),
            "diloco/residual_norm": residual_sq**0.5,
            "diloco/pseudo_grad_norm": delta_sq**0.5,
        }

    def pop_records(self) -> list[dict[str, float]]:
        """The metrics of each outer step since the last call (the trainer logs them per step)."""
        records, self.records = self.records, []
        return records

    def summary(self, records: list[dict[str, float]]) -> dict[str, float]:
        """One RL step's view of its outer steps: count, summed bytes and entries, density over
        them, last norms, and the run's totals (`diloco/total_*`); the totals only without any."""
        out = {f"diloco/total_{k}": v for k, v in self.totals.items()}
        out["diloco/inner_since_outer"] = float(self.inner)
        if not records:
            return out
        sums = {k: sum(r[f"diloco/{k}"] for r in records) for k in ("sent", "payload_bytes", "dense_bytes")}
        out.update({f"diloco/{k}": v for k, v in sums.items()})
        out["diloco/outer_steps"] = float(len(records))
        out["diloco/density"] = sum(r["diloco/density"] for r in records) / len(records)
        out["diloco/bytes_per_entry"] = sums["payload_bytes"] / max(sums["sent"], 1.0)
        for key in ("diloco/residual_norm", "diloco/pseudo_grad_norm"):
            out[key] = records[-1][key]
        return out

    # -- checkpoint ---------------------------------------------------------------------------
    def sharded_state_dict(self, position: int) -> dict[str, ShardedTensor]:
        """The anchor and momentum (the same on every island: island 0 saves them) and this
        island's residual, keyed by this rank's place in its island (`position`)."""
        out = {
            "anchor": ShardedTensor.from_rank_offsets(
                f"diloco.anchor.{position}", self.anchor, replica_id=self.island
            )
        }
        if self.momentum is not None:
            out["momentum"] = ShardedTensor.from_rank_offsets(
                f"diloco.momentum.{position}", self.momentum, replica_id=self.island
            )
        if self.residual is not None:
            out["residual"] = ShardedTensor.from_rank_offsets(
                f"diloco.residual.{self.island}.{position}", self.residual
            )
        return out

    def load_sharded(self, state: dict[str, Tensor]) -> None:
        """The loaded parts of `sharded_state_dict`; a residual or momentum the checkpoint lacks
        (saved in dense mode, or without momentum) starts at zero."""
        for name in ("anchor", "momentum", "residual"):
            mine = getattr(self, name)
            if mine is not None and name in state:
                mine.copy_(state[name])
            elif mine is not None:
                mine.zero_()

    def state_dict(self) -> dict[str, float | int]:
        """The counters (equal on every rank): the common part of a checkpoint."""
        return {"inner": self.inner, "outer_steps": self.outer_steps, **self.totals}

    def load_state_dict(self, state: dict) -> None:
        self.inner, self.outer_steps = int(state["inner"]), int(state["outer_steps"])
        self.totals = {k: float(state[k]) for k in self.totals}
