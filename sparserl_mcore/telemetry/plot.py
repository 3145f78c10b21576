"""The end-of-run PNG: one panel per thing a user checks first, drawn from metrics.jsonl.

Reading the JSONL file (not in-memory history) means the plot can be redrawn for any run, also a
killed or resumed one: `python -c "from sparserl_mcore.telemetry import plot_metrics; ..."`.
Only panels with logged data are drawn (a run without KL or without DGG gets no empty frame).
The per-optimizer-update panels (UPDATE_PANELS: the DWD signal and DGG's test) come from
updates.jsonl beside metrics.jsonl; update i of n in step s is drawn at x = s - 1 + i / n, so
every panel shares the step axis.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# A series is a metric key, or (numerator key, denominator key) for a ratio of two metrics.
Series = str | tuple[str, str]
# (title, [(series, legend label)], y scale). The keys are the trainer's metric names. Scales:
# "linear", "zero" (linear from 0, so a ratio reads as a height ratio), "log" (ratios of ~100x),
# "symlog" (linear within +-1, log beyond: z-scores of 0.3 and of 2000 on one axis).
PANELS: tuple[tuple[str, tuple[tuple[Series, str], ...], str], ...] = (
    ("train reward (mean)", (("rollout/reward_mean", "reward"),), "linear"),
    ("policy turns per episode (multi-turn)", (("agent/turns_mean", "turns"),), "zero"),
    (
        "greedy eval pass@1 (held-out)",
        (("eval/pass1_dense", "dense KV"), ("eval/pass1_compressed", "compressed KV")),
        "linear",
    ),
    (
        "saved vs dense (x less)",
        (
            (("rollout/dense_kv_bytes", "rollout/peak_kv_bytes"), "peak KV / request"),
            (("sync/dense_bytes", "sync/patch_bytes"), "weight sync bytes"),
        ),
        "zero",
    ),
    ("KL(pi_theta || pi_ref)", (("policy/kl", "k3 KL"),), "linear"),
    (
        "mismatch pi_old vs pi_sparse",
        (("correction/abs_logp_diff_mean", "|dlogp| mean"), ("correction/mismatch_kl", "mismatch KL")),
        "linear",
    ),
    (
        "updates per rollout batch",
        (("train/updates", "applied"), ("dgg/gates", "gated by DGG"), ("train/epochs", "epochs run")),
        "zero",
    ),
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
    (  # asynchronous runs only (train.async): how old the trained tokens were, in policy versions
        "staleness: lag of trained tokens",
        (("staleness/lag_mean", "mean lag"), ("staleness/lag_max", "max lag")),
        "zero",
    ),
)


# Per optimizer update (updates.jsonl). GATED: the z-score of the updates DGG dropped, as markers.
GATED = "gated (dropped, reuse ended)"
UPDATE_PANELS: tuple[tuple[str, tuple[tuple[Series, str], ...], str], ...] = (
    (
        "DWD: relative weight change per update",
        (("dwd/lm_head_rel_change", "lm_head"), ("dwd/middle_rel_change", "middle layers")),
        "log",
    ),
    ("DWD: lm_head / middle layers change", (("dwd/ratio", "ratio"),), "zero"),
    ("DGG: lm_head grad energy z-score", (("dgg/z", "z"), ("dgg/z", GATED)), "symlog"),
    (
        "grad norm per update",
        (("dgg/lm_head_grad_norm", "lm_head"), ("train/grad_norm", "global (before clip)")),
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


def _value(record: Mapping, series: Series) -> float | None:
    if isinstance(series, str):
        value = record.get(series)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    num, den = (_value(record, key) for key in series)
    return num / den if num is not None and den else None


def _series(records: Sequence[Mapping], series: Series) -> tuple[list[float], list[float]]:
    """(steps, values) of one series; a resumed run's re-logged steps keep their latest value."""
    by_step: dict[int, float] = {}
    for r in records:
        value = _value(r, series)
        if value is not None:
            by_step[int(r["step"])] = value
    steps = sorted(by_step)
    return [float(s) for s in steps], [by_step[s] for s in steps]


Curve = tuple[tuple[list[float], list[float]], str]


def drawable_panels(records: Sequence[Mapping]) -> list[tuple[str, list[Curve], str]]:
    """(title, [((steps, values), label)], scale) of every panel with at least one logged series."""
    panels = []
    for title, series, scale in PANELS:
        curves: list[Curve] = [(data, label) for key, label in series if (data := _series(records, key))[0]]
        if curves:
            panels.append((title, curves, scale))
    return panels


def _update_positions(records: Sequence[Mapping]) -> list[tuple[float, Mapping]]:
    """(x, record) per update: update i of the n logged for step s at s - 1 + i / n (a resumed
    run's re-logged step keeps its latest updates)."""
    by_step: dict[int, dict[int, Mapping]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), {})[int(r["update"])] = r
    out = []
    for step in sorted(by_step):
        updates = by_step[step]
        out += [(step - 1 + i / len(updates), updates[i]) for i in sorted(updates)]
    return out


def update_panels(records: Sequence[Mapping]) -> list[tuple[str, list[Curve], str]]:
    """UPDATE_PANELS with data, as drawable_panels; the GATED curve holds only the gated updates."""
    placed = _update_positions(records)
    panels = []
    for title, series, scale in UPDATE_PANELS:
        curves: list[Curve] = []
        for key, label in series:
            points = [
                (x, v)
                for x, r in placed
                if (v := _value(r, key)) is not None and (label != GATED or r.get("dgg/gated"))
            ]
            if points:
                curves.append((([x for x, _ in points], [v for _, v in points]), label))
        if any(label != GATED for _, label in curves):
            panels.append((title, curves, scale))
    return panels


def plot_metrics(
    jsonl_path: str | os.PathLike, out_png: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Draw PANELS from `jsonl_path` into `out_png` (written atomically); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    panels = drawable_panels(records)
    updates_path = Path(jsonl_path).with_name("updates.jsonl")
    if updates_path.is_file():
        panels += update_panels(read_metrics(updates_path))
    cols = min(4, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.7 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    for ax, (panel_title, curves, scale) in zip(axes.flat, panels, strict=False):
        dense = max(len(steps) for (steps, _), _ in curves) > 200  # per-update series
        for (steps, values), label in curves:
            if label == GATED:
                ax.plot(steps, values, "x", color="red", markersize=5, label=label)
            else:
                ax.plot(steps, values, marker="o", markersize=1 if dense else 3, linewidth=0.8, label=label)
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if scale == "log":
            ax.set_yscale("log")
        elif scale == "symlog":
            ax.set_yscale("symlog", linthresh=1.0)
        elif scale == "zero":
            ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # headroom for the legend
    run_dir = Path(jsonl_path).resolve().parent
    trained = {r["step"] for r in records if r["step"] > 0}  # eval-only rows share their step's number
    fig.suptitle(title or f"{run_dir}: {len(trained)} steps logged", fontsize=13)
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
