"""The paged KV pool: fixed-size pages of K and V for every layer, handed out with reference counts.

Layout: K and V are [layers, pages, page_size, kv_heads, head_dim]. A request owns a page table
(a list of page ids); its i-th cached entry lives in page `table[i // page_size]`, offset
`i % page_size`, in every layer. A page is referenced by the requests whose table holds it and by
the radix prefix cache; it returns to the free list when the last reference is dropped, so memory
given back by a finished or compressed request is reusable by the next step.
"""

from __future__ import annotations

import torch

from sparserl_mcore.rollout.engine.host_ints import long_tensor


class PoolExhaustedError(RuntimeError):
    """Not enough free pages; the scheduler reacts by evicting cache entries or retracting requests."""


class KVPool:
    """Page storage plus free list and per-page reference counts."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size}: both must be >= 1")
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        # Zero-filled: padded gather positions read real (masked) slots, never uninitialised NaNs.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, made once: a decode step asks for them in every layer
        self._k_flat = [self.k[layer].view(-1, kv_heads, head_dim) for layer in range(num_layers)]
        self._v_flat = [self.v[layer].view(-1, kv_heads, head_dim) for layer in range(num_layers)]
        self._k_rows = [self.k[layer].view(num_pages, -1) for layer in range(num_layers)]
        self._v_rows = [self.v[layer].view(num_pages, -1) for layer in range(num_layers)]
        self.page_size = page_size
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.peak_used = 0
        self.reserved: list[int] = []  # pages taken for good by the engine itself (`reserve`)

    @staticmethod
    def page_bytes_for(
        *, num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K+V bytes of one page over all layers (used to turn a byte capacity into pages)."""
        return 2 * num_layers * page_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def page_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> tuple[int, ...]:
        """The free list (a copy), for the resource invariants (rollout/engine/invariants.py)."""
        return tuple(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def k_flat(self, layer: int) -> torch.Tensor:
        """[pages * page_size, kv_heads, head_dim] view of one layer's keys (slot-addressed)."""
        return self._k_flat[layer]

    def v_flat(self, layer: int) -> torch.Tensor:
        return self._v_flat[layer]

    def k_rows(self, layer: int) -> torch.Tensor:
        """[pages, page_size * kv_heads * head_dim] view of one layer's keys: one row per page."""
        return self._k_rows[layer]

    def v_rows(self, layer: int) -> torch.Tensor:
        return self._v_rows[layer]

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with one reference each, or PoolExhaustedError (nothing taken)."""
        if n > len(self._free):
            raise PoolExhaustedError(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def reserve(self, n: int) -> list[int]:
        """n pages the pool gives away for good (held by `reserved`, never freed): scratch space
        that padded rows of a static decode step may read and write."""
        pages = self.alloc(n)
        self.reserved.extend(pages)
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} is free; cannot add a reference")
            self.refs[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} released twice")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)

    def slot_table(self, pages: list[int]) -> torch.Tensor:
        """Flat slot ids [len(pages) * page_size] for a page table (slice [:n] for n entries)."""
        table = long_tensor(pages, self.k.device)
        offsets = torch.arange(self.page_size, dtype=torch.long, device=self.k.device)
        return (table[:, None] * self.page_size + offsets[None, :]).reshape(-1)
