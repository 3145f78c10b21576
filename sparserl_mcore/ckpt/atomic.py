"""Write a directory all-or-nothing: build it under a temp name beside the target, rename at the end.

Every writer of a checkpoint directory (make-tiny, HF export, conversion) goes through this, so an
error or a kill never leaves a half-written directory at the path a user will load from, and what
it leaves has the modes the user's umask gives (`umask_modes`), not the private ones of mkdtemp and
safetensors. The temp
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


def output_problem(out: str | os.PathLike, *, directory: bool = True) -> str | None:
    """Why `out` (a directory, or with directory=False a file) cannot be written, or None.

    What a writer needs, tried the way it will do it: `out` is not the other kind of thing, its
    nearest existing ancestor is a directory (not a file), and a file can be created there
    (permissions, a read-only filesystem, a pseudo-filesystem). `os.access` is not enough: for
    root it says yes to almost everything.
    """
    path = pathlib.Path(out).absolute()
    if directory and path.exists() and not path.is_dir():
        return f"{out} exists and is not a directory"
    if not directory and path.is_dir():
        return f"{out} is a directory; give a file path"
    anchor = path if directory else path.parent
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        return f"{anchor} is a file, so {out} cannot be created"
    try:
        with tempfile.TemporaryFile(dir=anchor):
            pass
    except OSError as exc:
        return f"cannot create files in {anchor}: {exc.strerror or exc}"
    return None


def check_output_dir(out: str | os.PathLike, *, overwrite: bool) -> pathlib.Path:
    """Refuse a target that cannot be written, or a non-empty existing one unless `overwrite`
    (checked before any expensive work)."""
    path = pathlib.Path(out)
    problem = output_problem(path)
    if problem:
        raise ValueError(f"output {problem}")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"output directory {str(path)!r} is not empty; pass --overwrite to replace it")
    return path


def file_mode(*, directory: bool = False) -> int:
    """The mode a plain open() / mkdir() would give under this process's umask (0644 / 0755
    typically); for files made with mkstemp / mkdtemp, which are private (0600 / 0700)."""
    return (0o777 if directory else 0o666) & ~_umask()


def umask_modes(root: pathlib.Path) -> None:
    """Give `root` and every file and directory under it the mode open() / mkdir() would
    (`file_mode`): safetensors writes its files 0600 and mkdtemp its directories 0700, which would
    keep an output from the group and others whatever the user's umask says."""
    files, dirs = file_mode(), file_mode(directory=True)
    for entry in [root, *root.rglob("*")]:
        if not entry.is_symlink():
            entry.chmod(dirs if entry.is_dir() else files)


def _umask() -> int:
    """This process's umask, read without changing it (setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


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
    try:
        yield tmp
        umask_modes(tmp)
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
