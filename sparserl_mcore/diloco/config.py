"""The outer step's settings (pure Python: the run config validates them before any rank starts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODES = ("pulse", "dense")


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """How islands (`parallel.islands > 1`) meet: every `inner_steps` applied optimizer steps, one
    outer step of Nesterov SGD on the FP32 anchor with the islands' mean pseudo-gradient.

    mode: "pulse" (PULSELoCo: each rank sends only the entries of its pseudo-gradient, plus the
    carried residual, that would change a BF16 weight of the anchor, as FP32 values; the rest
    stays in the residual) or "dense" (DiLoCo: the whole FP32 pseudo-gradient, all-reduced).
    inner_steps: H. outer_lr / outer_momentum / nesterov: the outer SGD (DiLoCo's and the PULSE
    authors' defaults; Nesterov only acts with momentum > 0). zstd_level: compression of the pulse
    payload (null: raw index and value streams). Unused with one island.
    """

    mode: Literal["pulse", "dense"] = "pulse"
    inner_steps: int = 8
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    zstd_level: int | None = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: choose one of {', '.join(MODES)}")
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"inner_steps={self.inner_steps!r}: must be an integer >= 1 (optimizer steps)")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr={self.outer_lr!r}: must be > 0 (DiLoCo uses 0.7)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum={self.outer_momentum!r}: must be in [0, 1) (DiLoCo uses 0.9)")
        if self.zstd_level is not None and not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level!r}: must be 1..22, or null for raw streams")
