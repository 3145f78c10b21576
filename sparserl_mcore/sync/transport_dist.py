"""torch.distributed transport: each PP stage source broadcasts its fragment in buckets.

The group holds the stage source ranks and the receivers (rollout ranks; in tests, the learner
ranks themselves). Only encoded sparse fragments travel; when any receiver fails to apply them
(digest mismatch, wrong base), every receiver learns it through one all-reduce and the sources
broadcast dense fragments instead, which the failed receivers apply (the event is logged). The same
path with `full` fragments is the dense baseline. NCCL needs `device` to be the rank's GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from sparserl_mcore.sync.codec import PatchError

log = logging.getLogger(__name__)
CPU = torch.device("cpu")


class Receiver(Protocol):
    version: int | None

    def apply(self, parts: bytes | list[bytes]): ...


@dataclass(frozen=True, kw_only=True)
class BroadcastConfig:
    """bucket_bytes: the largest single broadcast (512 MiB, like slime's weight-update buckets)."""

    bucket_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be a positive byte count")


def broadcast_parts(
    parts: list[bytes] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    config: BroadcastConfig = BroadcastConfig(),
    device: torch.device = CPU,
) -> list[bytes]:
    """Broadcast `parts` (given on `src` only) to every rank of `group`; returns them everywhere."""
    is_src = dist.get_rank() == src
    count = torch.tensor([len(parts) if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(count, src, group=group)
    sizes = torch.tensor(
        [len(p) for p in parts] if is_src else [0] * int(count), dtype=torch.int64, device=device
    )
    dist.broadcast(sizes, src, group=group)
    total = int(sizes.sum())
    blob = bytearray(b"".join(parts)) if is_src else bytearray(total)
    for start in range(0, total, config.bucket_bytes):
        end = min(total, start + config.bucket_bytes)
        bucket = torch.frombuffer(blob, dtype=torch.uint8, offset=start, count=end - start)
        staged = bucket.to(device) if device.type != "cpu" else bucket
        dist.broadcast(staged, src, group=group)
        if staged is not bucket:
            bucket.copy_(staged.cpu())
    offsets = [0, *torch.cumsum(sizes.cpu(), 0).tolist()]
    return [bytes(blob[offsets[i] : offsets[i + 1]]) for i in range(len(offsets) - 1)]


@dataclass(frozen=True)
class SyncReport:
    version: int | None
    bytes_sent: int
    fell_back: bool  # some receiver in the group needed the dense fallback
    local_fallbacks: int  # receivers of this rank that did


class DistributedTransport:
    """One sync = every stage source broadcasts its fragment, every rank applies to its receivers."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        source_ranks: Sequence[int],
        config: BroadcastConfig = BroadcastConfig(),
        device: torch.device = CPU,
    ) -> None:
        self.group, self.source_ranks, self.config, self.device = group, tuple(source_ranks), config, device

    def _exchange(self, mine: list[bytes] | None) -> list[bytes]:
        out = []
        for src in self.source_ranks:
            out += broadcast_parts(
                mine if dist.get_rank() == src else None,
                src=src,
                group=self.group,
                config=self.config,
                device=self.device,
            )
        return out

    def sync(
        self, parts: list[bytes], full: Callable[[], list[bytes]], receivers: Sequence[Receiver]
    ) -> SyncReport:
        """Collective over the group. `parts`/`full`: this rank's fragments (used on sources only)."""
        fragments = self._exchange(parts)
        failed = []
        for receiver in receivers:
            try:
                receiver.apply(fragments)
            except PatchError as exc:
                log.warning(
                    "sparse sync failed on rank %d (%s); falling back to a full sync", dist.get_rank(), exc
                )
                failed.append(receiver)
        flag = torch.tensor([len(failed)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, group=self.group)
        sent = sum(len(f) for f in fragments)
        if int(flag):
            dense = self._exchange(full() if dist.get_rank() in self.source_ranks else None)
            sent += sum(len(f) for f in dense)
            for receiver in failed:
                receiver.apply(dense)
        version = receivers[0].version if receivers else None
        return SyncReport(
            version=version, bytes_sent=sent, fell_back=bool(int(flag)), local_fallbacks=len(failed)
        )

    def full_sync(self, full: Callable[[], list[bytes]], receivers: Sequence[Receiver]) -> SyncReport:
        """The dense baseline: every receiver gets every tensor."""
        dense = self._exchange(full() if dist.get_rank() in self.source_ranks else None)
        for receiver in receivers:
            receiver.apply(dense)
        version = receivers[0].version if receivers else None
        return SyncReport(
            version=version, bytes_sent=sum(len(f) for f in dense), fell_back=False, local_fallbacks=0
        )
