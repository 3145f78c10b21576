"""Directory / shared-filesystem transport: versioned patch files, full anchors, a manifest.

Layout under `root`:
    manifest.json                   {"format": 1, "latest": V, "entries": [{version, base_version,
                                     anchor_version, patch: [files], full: file | null}, ...]}
    v0000000011.f0.patch ...        sparse fragments of version 11 (one per PP stage)
    v0000000010.full                dense anchor of version 10
Every file, and the manifest last, is written to a temp name and renamed, so readers only ever see
complete files. A receiver at version v replays v+1..latest; a late joiner (or one whose apply
failed: hash mismatch, missing file) loads the newest anchor and replays the chain after it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparserl_mcore.ckpt.atomic import file_mode
from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import PatchError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 -> what open() would have made
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True, kw_only=True)
class DirectoryConfig:
    """anchor_every: a dense anchor every N versions; keep_anchors: anchors (and chains) kept."""

    anchor_every: int = 10
    keep_anchors: int = 2

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every={self.anchor_every} must be >= 1 (1 = every version dense)")
        if self.keep_anchors < 1:
            raise ValueError(f"keep_anchors={self.keep_anchors} must be >= 1")


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"format": 1, "latest": None, "entries": []}
    return json.loads(path.read_text())


class DirectoryPublisher:
    """Learner side: writes each version's patch fragments, and a dense anchor when due."""

    def __init__(self, root: Path, config: DirectoryConfig = DirectoryConfig()) -> None:
        self.root = Path(root)
        self.config = config
        self.manifest = read_manifest(self.root)

    def last_anchor(self) -> int | None:
        anchors = [e["version"] for e in self.manifest["entries"] if e["full"]]
        return anchors[-1] if anchors else None

    def anchor_due(self, version: int) -> bool:
        last = self.last_anchor()
        return last is None or version - last >= self.config.anchor_every

    def publish(
        self, *, version: int, base_version: int | None, parts: list[bytes], full: Callable[[], bytes] | None
    ) -> None:
        """Record `version`: sparse `parts` based on `base_version`, and `full()` if an anchor is due.

        The first version must come with `full` (there is nothing to replay from).
        """
        latest = self.manifest["latest"]
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the published {latest}")
        if self.anchor_due(version) and full is None:
            raise ValueError(
                f"version {version} needs a full anchor (anchor_every={self.config.anchor_every})"
            )
        entry: dict[str, Any] = {"version": version, "base_version": base_version, "patch": [], "full": None}
        if parts and base_version is not None:
            for i, part in enumerate(parts):
                name = f"v{version:010d}.f{i}.patch"
                atomic_write_bytes(self.root / name, part)
                entry["patch"].append(name)
        if self.anchor_due(version):
            assert full is not None  # refused above, before anything was written
            entry["full"] = f"v{version:010d}.full"
            atomic_write_bytes(self.root / entry["full"], full())
        entry["anchor_version"] = version if entry["full"] else self.last_anchor()
        self.manifest["entries"].append(entry)
        self.manifest["latest"] = version
        self._prune()
        atomic_write_bytes(self.root / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    def _prune(self) -> None:
        anchors = [e["version"] for e in self.manifest["entries"] if e["full"]]
        if len(anchors) <= self.config.keep_anchors:
            return
        oldest_kept = anchors[-self.config.keep_anchors]
        dropped = [e for e in self.manifest["entries"] if e["version"] < oldest_kept]
        self.manifest["entries"] = [e for e in self.manifest["entries"] if e["version"] >= oldest_kept]
        # the manifest that no longer names them is written before the files go
        atomic_write_bytes(self.root / MANIFEST, json.dumps(self.manifest, indent=1).encode())
        for e in dropped:
            for name in [*e["patch"], *([e["full"]] if e["full"] else [])]:
                (self.root / name).unlink(missing_ok=True)


class DirectorySubscriber:
    """Receiver side: brings an `HFReceiver` to the latest published version.

    Counts `fallbacks` (full reloads after a failed sparse apply) and logs each one.
    """

    def __init__(self, root: Path, receiver: HFReceiver) -> None:
        self.root = Path(root)
        self.receiver = receiver
        self.fallbacks = 0
        self.bytes_read = 0

    def _read(self, name: str) -> bytes:
        data = (self.root / name).read_bytes()
        self.bytes_read += len(data)
        return data

    def _replay(self, entries: list[dict], start: int | None) -> None:
        for e in entries:
            if start is not None and e["version"] <= start:
                continue
            if e["base_version"] != self.receiver.version or not e["patch"]:
                raise PatchError(f"no patch from version {self.receiver.version} to {e['version']}")
            self.receiver.apply([self._read(name) for name in e["patch"]])

    def _from_anchor(self, entries: list[dict]) -> None:
        anchors = [e for e in entries if e["full"]]
        if not anchors:
            raise PatchError(f"{self.root} holds no full anchor to start from")
        self.receiver.apply(self._read(anchors[-1]["full"]))
        self._replay(entries, anchors[-1]["version"])

    def poll(self) -> int | None:
        """Apply whatever is new; returns the version now held."""
        manifest = read_manifest(self.root)
        latest, entries = manifest["latest"], manifest["entries"]
        if latest is None or latest == self.receiver.version:
            return self.receiver.version
        if self.receiver.version is not None:
            try:
                self._replay(entries, self.receiver.version)
                return self.receiver.version
            except (PatchError, FileNotFoundError) as exc:
                self.fallbacks += 1
                log.warning("sparse sync to version %s failed (%s); falling back to a full sync", latest, exc)
        self._from_anchor(entries)
        return self.receiver.version
