"""Islands: groups of whole data-parallel replicas that train apart and meet every H steps (DiLoCo).

Rank placement: with `islands > 1` megatron's grid is built in `tp-cp-ep-pp-dp` order (data
parallel outermost), so every DP replica, and so every island, is one contiguous block of ranks:
island i holds ranks [i * S, (i + 1) * S) with S = world / islands, which is what a launcher puts
on one node group (`sparserl slurm`). With PP = 1 this is megatron's default order.

`split_groups` (collective over the world) derives from megatron's `ProcessGroupCollection`:
- the island's collection: every group that spans several islands (dp, dp_cp, tp_dp_cp, the
  expert data-parallel groups, ...) is cut down to this rank's island, the others are kept as
  they are. Megatron's DDP and distributed optimizer take it (`pg_collection`), so gradients are
  reduced, and FP32 master weights sharded, inside the island only;
- the island group: every rank of this island;
- the cross-island group: the rank at this rank's place in every island. They hold the same
  model shard and the same distributed-optimizer range of it, so the outer sync lines up their
  FP32 shards element for element with no regathering.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

# megatron's rank order when islands > 1: a DP replica is a contiguous block of ranks
ISLAND_ORDER = "tp-cp-ep-pp-dp"


@dataclass(frozen=True)
class IslandGroups:
    """This rank's island and the groups `split_groups` built for it."""

    island: int
    islands: int
    groups: ProcessGroupCollection  # megatron's collection restricted to this island
    island_group: dist.ProcessGroup  # every rank of this island
    cross_island: dist.ProcessGroup  # this rank's counterparts, one per island (island order)


def island_of(rank: int, world_size: int, islands: int) -> int:
    """The island of a global rank: islands are contiguous blocks of world_size / islands ranks."""
    return rank // (world_size // islands)


def _group_ranks(groups: ProcessGroupCollection) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in fields(ProcessGroupCollection):
        group = getattr(groups, f.name, None)
        if isinstance(group, dist.ProcessGroup):
            out[f.name] = tuple(dist.get_process_group_ranks(group))
    return out


class _Maker:
    """`dist.new_group` once per distinct rank list (every rank calls it for every list, in order)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def __call__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        if ranks not in self.made:
            self.made[ranks] = dist.new_group(list(ranks))
        return self.made[ranks] if self.rank in ranks else None


def split_groups(groups: ProcessGroupCollection, *, rank: int, world_size: int, islands: int) -> IslandGroups:
    """Collective over the world: the island-restricted collection, island and cross-island groups."""
    size = world_size // islands
    everyone: list[dict[str, tuple[int, ...]] | None] = [None] * world_size
    dist.all_gather_object(everyone, _group_ranks(groups))
    restricted = ProcessGroupCollection()
    for f in fields(ProcessGroupCollection):
        if hasattr(groups, f.name):
            setattr(restricted, f.name, getattr(groups, f.name))
    make = _Maker(rank)
    names = sorted({name for ranks in everyone if ranks for name in ranks})
    for name in names:
        lists = sorted({ranks[name] for ranks in everyone if ranks and name in ranks})
        if all(len({r // size for r in ranks}) == 1 for ranks in lists):
            continue  # already inside one island (tp, pp, mp, cp, embd, ...)
        for ranks in lists:
            for i in range(islands):
                part = tuple(r for r in ranks if r // size == i)
                group = make(part) if part else None
                if group is not None:
                    setattr(restricted, name, group)
    island_group = cross = None
    for i in range(islands):
        island_group = make(tuple(range(i * size, (i + 1) * size))) or island_group
    for p in range(size):
        cross = make(tuple(p + i * size for i in range(islands))) or cross
    assert island_group is not None and cross is not None, "every rank is in one island and one cross group"
    return IslandGroups(
        island=rank // size, islands=islands, groups=restricted, island_group=island_group, cross_island=cross
    )
