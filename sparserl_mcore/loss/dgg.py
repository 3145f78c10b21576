"""Dynamic Gradient Gating: drop an update, and stop reusing the rollout batch, on an lm_head spike.

The signal is the lm_head gradient energy g = ||grad W_lm_head||_F^2 of each optimizer update
(after accumulation and DP reduction, before the step); see `lm_head_grad.py` for how it is
measured across TP/PP/DP. The gate keeps a sliding window of the statistic (g, or its increment
dg = g - g_prev) over ACCEPTED updates and flags an update whose z-score
    z = (x - mean(window)) / (std(window) + eps)
exceeds tau -- only once the window is full and only at reuse index k > 1 (the first pass over a
fresh rollout batch is never gated; it also keeps feeding the window, so a genuine drift of g is
learned from first passes and cannot lock the gate shut).

How many times a batch is reused (K epochs) is not the gate's business: the update step's
`UpdateConfig.epochs` (run config `train.reuse_epochs`) sets it, the gate only ends the reuse early.

Defaults and why (the paper gives K = 4 and the tau range, not the window):
  tau = 0.5        the top of the paper's recommended 0.1-0.5: fewest false gates of that range.
  window = 8       two rollout batches of history at K = 4: short enough to follow the drift of g
                   during training, long enough for a usable std.
  statistic = "g"  the energy itself is what spikes at collapse; "dg" reacts to sudden jumps only.
  weight_change    log the DWD signal per applied update (loss/weight_change.py): on by default,
                   it costs one copy of lm_head's and the middle layers' owned main weights.

The gate holds plain Python state and is deterministic: ranks that feed it the same all-reduced g
reach the same decision. The training step still all-reduces the decision (see megatron_step).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

STATISTICS = ("g", "dg")


@dataclass(frozen=True, kw_only=True)
class DGGConfig:
    enabled: bool = True
    tau: float = 0.5
    window: int = 8
    statistic: str = "g"
    eps: float = 1e-12
    weight_change: bool = True

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window={self.window} must be >= 2 (a std needs two values)")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic={self.statistic!r} is unknown; choose from {list(STATISTICS)}")
        if not math.isfinite(self.tau):
            raise ValueError(f"tau={self.tau} must be finite")
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be > 0")


@dataclass(frozen=True)
class GateDecision:
    """One update's verdict. z is None while the window is not yet full (never gated then)."""

    gate: bool
    energy: float
    stat: float | None
    z: float | None
    reuse_index: int

    def as_metrics(self) -> dict[str, float]:
        out = {
            "dgg/lm_head_grad_sq": self.energy,
            "dgg/lm_head_grad_norm": math.sqrt(max(self.energy, 0.0)),
            "dgg/gated": float(self.gate),
            "dgg/reuse_index": float(self.reuse_index),
        }
        if self.z is not None:
            out["dgg/z"] = self.z
        return out


class DynamicGradientGate:
    """Sliding-window z-score test on the lm_head gradient energy; `decide` then `update`."""

    def __init__(self, cfg: DGGConfig | None = None) -> None:
        self.cfg = cfg or DGGConfig()
        self._window: deque[float] = deque(maxlen=self.cfg.window)
        self._last_energy: float | None = None

    def _stat(self, energy: float) -> float | None:
        if self.cfg.statistic == "g":
            return energy
        return None if self._last_energy is None else energy - self._last_energy

    def decide(self, energy: float, reuse_index: int) -> GateDecision:
        """Verdict for an update with lm_head energy `energy` at reuse index k (1-based); no state change."""
        if reuse_index < 1:
            raise ValueError(f"reuse_index={reuse_index} must be >= 1 (1 = first pass over the batch)")
        energy = float(energy)
        stat = self._stat(energy)
        if stat is None or len(self._window) < self.cfg.window:
            return GateDecision(gate=False, energy=energy, stat=stat, z=None, reuse_index=reuse_index)
        mean = sum(self._window) / len(self._window)
        std = math.sqrt(sum((x - mean) ** 2 for x in self._window) / (len(self._window) - 1))
        z = (stat - mean) / (std + self.cfg.eps)
        gate = self.cfg.enabled and reuse_index > 1 and z > self.cfg.tau
        return GateDecision(gate=gate, energy=energy, stat=stat, z=z, reuse_index=reuse_index)

    def update(self, decision: GateDecision) -> None:
        """Record an accepted update (a gated one is an outlier and stays out of the window)."""
        if decision.gate:
            return
        if decision.stat is not None:
            self._window.append(decision.stat)
        self._last_energy = decision.energy

    def state_dict(self) -> dict:
        return {"window": list(self._window), "last_energy": self._last_energy}

    def load_state_dict(self, state: dict) -> None:
        self._window = deque(state["window"], maxlen=self.cfg.window)
        self._last_energy = state["last_energy"]
