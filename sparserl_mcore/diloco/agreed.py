"""The weights every island agreed on, as the rollout sync diffs them: bf16 of the anchor.

Between outer steps each island's model moves on by itself, so the engines are patched only with
the anchor's BF16 values (`trainer.weight_sync.WeightSyncer(agreed=...)`), never with an island's
local weights. The anchor is identical on every island (checked after each outer step), so island
0's ranks alone send: each its owned master range of each parameter, as a compact BF16 tensor
(`sync.learner.ShardSyncer` reads a tensor of exactly the range's length as the range itself);
the other islands' ranks own nothing and send empty fragments.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sparserl_mcore.diloco.outer import OuterStep


class AgreedWeights:
    """Named compact BF16 tensors of the anchor with their owned ranges (`ranges`)."""

    def __init__(self, outer: OuterStep, *, sender: bool) -> None:
        self.outer, self.sender = outer, sender
        device = outer.anchor.device
        empty = torch.zeros(0, dtype=torch.bfloat16, device=device)
        self.ranges: dict[str, tuple[int, int]] = {name: (0, 0) for name, _ in outer.shards.params}
        self._params = {name: empty for name, _ in outer.shards.params}
        for s in outer.shards.shards if sender else ():
            self.ranges[s.name] = (s.start, s.end)
            self._params[s.name] = torch.empty(s.end - s.start, dtype=torch.bfloat16, device=device)
        self.refresh()

    def refresh(self) -> None:
        """Recast from the anchor (after an outer step; cheap: 2 bytes per owned element)."""
        for s in self.outer.shards.shards if self.sender else ():
            self._params[s.name].copy_(self.outer.anchor[s.offset : s.offset + s.end - s.start])

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params.items())
