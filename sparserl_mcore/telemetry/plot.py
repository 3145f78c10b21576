"""The end-of-run PNG: one panel per thing a user checks first, drawn from metrics.jsonl.

Reading the JSONL file (not in-memory history) means the plot can be redrawn for any run, also a
killed or resumed one: `python -c "from sparserl_mcore.telemetry import plot_metrics; ..."`.
A panel whose metrics were never logged says so instead of silently showing an empty frame.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

# (title, [(metric key, legend label)], y scale). The keys are the trainer's metric names. Scales:
# "linear", "zero" (linear from 0, so a ratio reads as a height ratio), "log" (ratios of ~100x).
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("train reward (mean)", (("rollout/reward_mean", "reward"),), "linear"),
    ("eval pass@1", (("eval/pass1_dense", "dense KV"), ("eval/pass1_compressed", "compressed KV")), "linear"),
    ("KL(pi_theta || pi_ref)", (("policy/kl", "k3 KL"),), "linear"),
    (
        "mismatch pi_old vs pi_sparse",
        (("correction/abs_logp_diff_mean", "|dlogp| mean"), ("correction/mismatch_kl", "mismatch KL")),
        "linear",
    ),
    ("DGG", (("dgg/gates", "gated updates"), ("train/epochs", "update epochs")), "linear"),
    (
        "Sparse-RL correction",
        (
            ("correction/vetoed_frac", "vetoed seq frac"),
            ("correction/rejected_token_frac", "rejected token frac"),
        ),
        "linear",
    ),
    (
        "peak KV bytes / request",
        (("rollout/peak_kv_bytes", "compressed"), ("rollout/dense_kv_bytes", "dense")),
        "zero",
    ),
    (
        "weight sync bytes / step",
        (("sync/patch_bytes", "sparse patch"), ("sync/dense_bytes", "dense BF16")),
        "log",
    ),
)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Step records of a metrics.jsonl file (event lines and unreadable tail lines are skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial last line
        if isinstance(record, dict) and "step" in record and "event" not in record:
            records.append(record)
    return records


def _series(records: list[Mapping], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; a resumed run's re-logged steps keep their latest value."""
    by_step: dict[int, float] = {}
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            by_step[int(r["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_metrics(
    jsonl_path: str | os.PathLike, out_png: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Draw PANELS from `jsonl_path` into `out_png` (written atomically); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    for ax, (panel_title, keys, scale) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for key, label in keys:
            steps, values = _series(records, key)
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn = True
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
            if scale == "log":
                ax.set_yscale("log")
            elif scale == "zero":
                ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # headroom for the legend
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    run_dir = Path(jsonl_path).resolve().parent
    fig.suptitle(title or f"{run_dir}: {len(records)} logged steps", fontsize=13)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=90)
        tmp.replace(out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out
