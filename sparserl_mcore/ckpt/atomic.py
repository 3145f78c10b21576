"""Write a directory all-or-nothing: build it under a temp name beside the target, rename at the end.

Every writer of a checkpoint directory (make-tiny, HF export, conversion) goes through this, so an
error or a kill never leaves a half-written directory at the path a user will load from. The temp
name carries the writer's host and pid (`.out.tmp-<host>-<pid>-XXXX`): a writer killed outright
(SIGKILL, OOM) leaves its temp behind, and the next writer of the same target removes the temps
of writers on this host that are no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: str | os.PathLike) -> list[pathlib.Path]:
    """Remove the temp (and replaced-old) directories of dead writers of `out` on this host."""
    path = pathlib.Path(out)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-{re.escape(_host())}-(\d+)(?:-|$)")
    removed = []
    for entry in path.parent.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def check_output_dir(out: str | os.PathLike, *, overwrite: bool) -> pathlib.Path:
    """Refuse a non-empty existing target unless `overwrite` (checked before any expensive work)."""
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output path {str(path)!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"output directory {str(path)!r} is not empty; pass --overwrite to replace it")
    return path


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[pathlib.Path]:
    """Yield a fresh temp directory on the same filesystem; on success it replaces `out`.

    On any exception the temp directory is removed and `out` is left as it was.
    """
    path = check_output_dir(out, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    owner = f"{_host()}-{os.getpid()}"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{owner}-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like a mkdir
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{owner}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
