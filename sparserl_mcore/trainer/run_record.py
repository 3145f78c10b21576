"""What a training checkpoint says about the run that saved it, readable without torch or megatron.

Beside megatron's files every checkpoint directory holds `run.json` (written by rank 0 before the
directory is renamed into place): the step, the full run config, the world size, the layout it was
saved at (`run_layout.RunLayout`), the prompt sampler's position and the size of every file of the
checkpoint (`damage` compares them, so a truncated shard is refused before any rank loads it). The
launching process reads it before any rank starts, to say what a resumed run continues from and
what changed since, to refuse a resume that cannot continue (another dataset, a layout that cannot
load, a damaged checkpoint), and to stop a run that is already complete before it writes anything.

    path = latest_checkpoint("runs/x/checkpoints")          # None: nothing to resume
    saved = read_saved_run(path)                              # SavedRun(step=20, config={...}, ...)
    config_changes(saved.config, to_dict(cfg))                # [("train.steps", 20, 40), ...]
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from sparserl_mcore.trainer.run_layout import RunLayout, resume_problem

LATEST = "latest"  # text file in the checkpoint root naming the newest complete checkpoint
RECORD = "run.json"


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """A complete checkpoint and the run that wrote it (config etc. None for a checkpoint written
    before run.json existed)."""

    path: Path
    step: int
    config: dict[str, Any] | None = None
    world_size: int | None = None
    data: dict[str, Any] | None = None
    layout: RunLayout | None = None
    files: dict[str, int] | None = None  # every file of the checkpoint and its size in bytes


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none yet."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{marker} names {path}, which is not a complete dist checkpoint")
    return path


def rng_file(checkpoint: Path, rank: int) -> Path:
    """Where rank `rank`'s RNG streams are saved in a checkpoint directory."""
    return checkpoint / f"rng_rank{rank:05d}.safetensors"


def write_record(
    directory: Path,
    *,
    step: int,
    config: dict[str, Any],
    world_size: int,
    data: dict[str, Any],
    layout: RunLayout,
) -> None:
    record = {
        "step": step,
        "world_size": world_size,
        "layout": layout.to_dict(),
        "data": data,
        "files": _sizes(directory),
        "config": config,
    }
    (directory / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def _sizes(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under `directory` (written once all ranks are done)."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != RECORD
    }


def read_saved_run(path: Path) -> SavedRun:
    """The record of checkpoint `path`; a checkpoint without one still gives its step (dir name)."""
    record_file = path / RECORD
    if not record_file.is_file():
        return SavedRun(path=path, step=int(path.name.rpartition("_")[2]))
    try:
        record = json.loads(record_file.read_text())
        return SavedRun(
            path=path,
            step=int(record["step"]),
            config=record.get("config"),
            world_size=record.get("world_size"),
            data=record.get("data"),
            layout=RunLayout.from_dict(record["layout"]) if record.get("layout") else None,
            files={str(k): int(v) for k, v in record["files"].items()} if record.get("files") else None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{record_file} is not a valid run record ({exc})") from None


# What every megatron dist checkpoint holds, for checkpoints whose record lists no files
DIST_CKPT_FILES = ("metadata.json", ".metadata")


def damage(saved: SavedRun) -> str | None:
    """What is missing, cut short or unreadable in checkpoint `saved`, or None: every file its
    record lists, at the recorded size (a shard cut by a full disk or a copy fails the load inside
    every rank otherwise); for an older record without the list, megatron's metadata files."""
    expected: dict[str, int | None] = dict(saved.files or dict.fromkeys(DIST_CKPT_FILES))
    for name, size in expected.items():
        path = saved.path / name
        try:
            actual = path.stat().st_size
            with path.open("rb"):
                pass
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as exc:
            return f"{path} cannot be read: {exc.strerror or exc}"
        if size is not None and actual != size:
            return f"{path} has {actual} bytes where the checkpoint wrote {size} (cut short or replaced)"
    return _metadata_damage(saved.path / "metadata.json")


def _metadata_damage(path: Path) -> str | None:
    """megatron's checkpoint metadata (JSON, read before any shard): what every rank's load would
    fail on, or None. `.metadata` (torch's, a pickle) is never opened here: it is not ours to
    unpickle before the ranks, which load it through torch's own checkpoint reader."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{path} is not readable megatron checkpoint metadata ({type(exc).__name__})"
    if not isinstance(meta, dict) or not isinstance(meta.get("sharded_backend"), str):
        return f"{path} names no sharded_backend: not megatron checkpoint metadata"
    return None


def check_resumable(saved: SavedRun, requested: RunLayout) -> str | None:
    """One line naming the checkpoint, its layout and `requested` when a run at `requested` cannot
    load it; None when it can."""
    rng_files = all(rng_file(saved.path, r).is_file() for r in range(requested.world_size))
    problem = resume_problem(saved.layout, requested, same_world_files=rng_files)
    return f"{saved.path}: {problem}" if problem else None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for every key whose value differs."""
    old, new = _flatten(saved), _flatten(current)
    missing = object()
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            changes.append((key, None if a is missing else a, None if b is missing else b))
    return changes
