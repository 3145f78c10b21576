"""The policy versions the learner published, and the version lag of sampled tokens.

A version is labelled by the step that produced it (the engines' `weight_version`), but a step whose
updates were all gated, skipped or empty publishes none. So a token's lag counts PUBLISHED versions:
lag(v) = how many versions newer than v the learner has published up to its current one (0: the
token was sampled by the weights the learner trains from). That is the unit of `train.async
.max_staleness`. Only the last `KEEP` versions are kept; an older token's lag reads as KEEP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KEEP = 64


class PolicyVersions:
    """Published versions, oldest first; the last is the learner's current one."""

    def __init__(self, published: Sequence[int] = (0,)) -> None:
        if not published or list(published) != sorted(set(published)):
            raise ValueError(f"published versions {list(published)} must be non-empty and increasing")
        self._published = list(published)[-KEEP:]

    @property
    def current(self) -> int:
        return self._published[-1]

    def publish(self, version: int) -> None:
        """The learner's weights became `version` (synced to the engines)."""
        if version <= self.current:
            raise ValueError(f"version {version} is not newer than the current {self.current}")
        self._published = [*self._published, version][-KEEP:]

    def lag(self, versions: torch.Tensor) -> torch.Tensor:
        """Per element of `versions` (token versions, any shape): published versions since it."""
        table = torch.tensor(self._published, dtype=torch.long)
        seen = torch.searchsorted(table, versions.to(torch.long), right=True)  # published <= v
        return len(self._published) - seen

    def state_dict(self) -> list[int]:
        return list(self._published)
