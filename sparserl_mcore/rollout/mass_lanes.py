"""H2O's accumulated attention for every running request, held as lanes of ONE buffer.

Why one buffer: a decode step's attention mass arrives as one [L, B, Hk, N] tensor for the whole
batch (paged_attention.decode_attention), entry j of request b being its slot j. With one row
(lane) per request in a shared [L, lanes, Hk, capacity] buffer, the step adds it with a single
`index_add_` instead of one slice-and-add per request, and a compression reads and rewrites the
lanes of all its requests with one gather and one copy. Padding entries of the decode mass are
exactly 0 (masked before the softmax), so adding them past a request's length changes nothing.
"""

from __future__ import annotations

import torch


class AttentionMassLanes:
    """Accumulated attention [L, Hk, capacity] per request; a request holds a lane while it runs."""

    def __init__(self, layers: int, kv_heads: int, lanes: int, device: torch.device | str) -> None:
        if lanes < 1:
            raise ValueError(f"lanes={lanes}: need at least one (one per running request)")
        self.buf = torch.zeros(layers, lanes, kv_heads, 0, device=device)
        self._free = list(range(lanes - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.buf.shape[-1]

    def acquire(self, capacity: int) -> int:
        """A zeroed lane holding at least `capacity` positions (the buffer grows for every lane)."""
        if not self._free:
            raise RuntimeError(f"all {self.buf.shape[1]} lanes in use: release finished requests' lanes")
        if capacity > self.capacity:
            grown = self.buf.new_zeros(*self.buf.shape[:-1], capacity)
            grown[..., : self.capacity] = self.buf
            self.buf = grown
        return self._free.pop()

    def release(self, lane: int) -> None:
        self.buf[:, lane].zero_()
        self._free.append(lane)

    def add(self, lanes: torch.Tensor, mass: torch.Tensor) -> None:
        """Add mass [L, len(lanes), Hk, N <= capacity] (slot order) to the given distinct lanes."""
        self.buf[..., : mass.shape[-1]].index_add_(1, lanes, mass)

    def read(self, lanes: torch.Tensor, n: int) -> torch.Tensor:
        """The first n positions of the given lanes: [len(lanes), L, Hk, n] (a copy)."""
        return self.buf[..., :n].index_select(1, lanes).transpose(0, 1)

    def replace(self, lanes: torch.Tensor, kept: torch.Tensor) -> None:
        """After a compression: lanes hold kept [len(lanes), L, Hk, k] in slots [0, k), zeros after."""
        rows = self.buf.new_zeros(self.buf.shape[0], len(lanes), *self.buf.shape[2:])
        rows[..., : kept.shape[-1]] = kept.transpose(0, 1)
        self.buf.index_copy_(1, lanes, rows)
