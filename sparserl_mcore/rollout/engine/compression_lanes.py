"""Per-request compression state of the running batch, held as lanes of shared buffers.

Two kinds of state follow a request between compressions: the ring of its last `window` queries
(SnapKV / R-KV score with them) and, for H2O, the attention mass each cached entry has received.
Both arrive once per step for the whole batch (queries [L, rows, Hq, d] from the forward, mass
[L, B, Hk, N] from paged_attention.decode_attention, entry j of request b being its slot j).
With one row (lane) per running request in shared buffers, a step stores them with ONE indexed
write instead of one small copy per request, and a compression reads the lanes of all its
requests with one indexed read: on small batches the per-op overhead is the cost, not the bytes.
Padding entries of the decode mass are exactly 0 (masked before the softmax), so adding them past
a request's length changes nothing.
"""

from __future__ import annotations

import torch


class CompressionLanes:
    """Window-query rings [L, lanes * window, Hq, d] (lane-major) and/or H2O mass [L, lanes, Hk, cap]."""

    def __init__(
        self,
        *,
        layers: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        window: int,
        lanes: int,
        queries: bool,
        mass: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes={lanes}: need at least one (one per running request)")
        self.num_lanes, self.window = lanes, window
        ring_shape = (layers, lanes * window, q_heads, head_dim)  # one index dim: index_copy_ / index_select
        self.queries = torch.zeros(ring_shape, dtype=dtype, device=device) if queries else None
        self.mass = torch.zeros(layers, lanes, kv_heads, 0, device=device) if mass else None
        self._free = list(range(lanes - 1, -1, -1))

    def _ring(self) -> torch.Tensor:
        if self.queries is None:
            raise RuntimeError("these lanes keep no query ring (the policy scores without queries)")
        return self.queries

    def _mass(self) -> torch.Tensor:
        if self.mass is None:
            raise RuntimeError("these lanes keep no attention mass (only H2O accumulates it)")
        return self.mass

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_lanes(self) -> tuple[int, ...]:
        """The free lanes (a copy), for the resource invariants (rollout/engine/invariants.py)."""
        return tuple(self._free)

    def acquire(self, mass_capacity: int) -> int:
        """A lane with zero mass for at least `mass_capacity` entries (the mass buffer grows for all)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_lanes} lanes in use: release finished requests' lanes")
        if self.mass is not None and mass_capacity > self.mass.shape[-1]:
            grown = self.mass.new_zeros(*self.mass.shape[:-1], mass_capacity)
            grown[..., : self.mass.shape[-1]] = self.mass
            self.mass = grown
        return self._free.pop()

    def release(self, lane: int) -> None:
        if self.mass is not None:
            self.mass[:, lane].zero_()
        self._free.append(lane)

    def ring_row(self, lane: int, seen: int) -> int:
        """Row of the query ring that the next query of a lane goes to after `seen` queries (plain
        ints: the scheduler computes one per stored query, in Python, cheaper than tensor ops)."""
        return lane * self.window + seen % self.window

    def push_queries(self, rows: torch.Tensor, q: torch.Tensor) -> None:
        """Store q [L, R, Hq, d]: query i goes to ring row rows[i] (`ring_row`; rows distinct)."""
        self._ring().index_copy_(1, rows, q)

    def window_queries(self, lanes: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """Queries at ring positions ring [B, w] (oldest first) of the B lanes: [B, L, Hq, w, d]."""
        rows = self._ring().index_select(1, (lanes[:, None] * self.window + ring).view(-1))
        return rows.view(rows.shape[0], *ring.shape, *rows.shape[2:]).permute(1, 0, 3, 2, 4)

    def add_mass(self, lanes: torch.Tensor, mass: torch.Tensor) -> None:
        """Add mass [L, len(lanes), Hk, N <= capacity] (slot order) to the given distinct lanes."""
        self._mass()[..., : mass.shape[-1]].index_add_(1, lanes, mass)

    def read_mass(self, lanes: torch.Tensor, n: int) -> torch.Tensor:
        """The first n entries of the given lanes: [len(lanes), L, Hk, n] (a copy)."""
        return self._mass()[..., :n].index_select(1, lanes).transpose(0, 1)

    def replace_mass(self, lanes: torch.Tensor, kept: torch.Tensor) -> None:
        """After a compression: lanes hold kept [len(lanes), L, Hk, k] in slots [0, k), zeros after."""
        mass = self._mass()
        mass.index_fill_(1, lanes, 0.0)
        mass[..., : kept.shape[-1]].index_copy_(1, lanes, kept.transpose(0, 1))
