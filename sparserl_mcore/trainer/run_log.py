"""Run metrics on the host rank: metrics.jsonl (one line per step and per event), a one-line rich
summary per step, and a PNG plot of the main curves at the end."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

PLOTTED = (
    ("rollout/reward_mean", "reward"),
    ("eval/pass1_compressed", "eval pass@1 (compressed)"),
    ("eval/pass1_dense", "eval pass@1 (dense)"),
    ("policy/kl", "KL to ref"),
    ("correction/abs_logp_diff_mean", "|logp_old - logp_sparse|"),
    ("dgg/gates", "DGG gates"),
    ("rollout/peak_kv_bytes", "peak KV bytes"),
    ("sync/patch_bytes", "sync bytes"),
)


class RunLog:
    def __init__(self, cfg: Any, *, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.dir = Path(cfg.dir)
        self.path = self.dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            from rich.console import Console

            self.console = Console(stderr=False)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._write(record)
        if self.cfg.progress:
            shown = {
                "reward": "rollout/reward_mean",
                "eval": "eval/pass1_compressed",
                "kv": "rollout/peak_kv_bytes",
                "sync": "sync/patch_bytes",
                "gates": "dgg/gates",
                "vetoed": "correction/vetoed_sequences",
            }
            parts = [f"{k}={record[v]:.4g}" for k, v in shown.items() if v in record]
            self.console.print(f"[bold cyan]step {step}[/] " + " ".join(parts))

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({"event": kind, "time": time.time(), **{k: _plain(v) for k, v in fields.items()}})
        self.console.print(f"[yellow]event[/] {kind}: {fields}")

    def close(self) -> dict[str, Path]:
        if not self.enabled:
            return {}
        paths = {"metrics": self.path}
        if self.cfg.plot and self.history:
            paths["plot"] = self._plot()
        return paths

    def _plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 4, figsize=(16, 7))
        for ax, (key, title) in zip(axes.flat, PLOTTED, strict=True):
            pts = [(r["step"], r[key]) for r in self.history if key in r and math.isfinite(r[key])]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".")
            ax.set_title(title)
            ax.set_xlabel("step")
        fig.tight_layout()
        out = self.dir / "summary.png"
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return out


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list)) else str(value)
