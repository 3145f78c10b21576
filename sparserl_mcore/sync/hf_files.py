"""Read and atomically write HF-layout weights: one safetensors file or an HF directory.

A directory is read through its `model.safetensors.index.json` when present (else every
`*.safetensors` file); writing a directory keeps the source's file split and copies its other
files (config, tokenizer), so `sync apply` produces a loadable HF checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sparserl_mcore.ckpt.atomic import file_mode, umask_modes

INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> list[str]:
    """The safetensors file names of a file or an HF directory (its index's, else `*.safetensors`)."""
    path = Path(path)
    if path.is_file():
        return [path.name]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a safetensors file nor an HF directory")
    if (path / INDEX).exists():
        return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path} holds no *.safetensors files")
    return found


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file / HF directory (CPU, contiguous)."""
    path = Path(path)
    root = path.parent if path.is_file() else path
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        for name, tensor in _read(root / file).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one file of {path}")
            state[name] = tensor.contiguous()
    return state


def _read(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except OSError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise ValueError(f"{file} is not a readable safetensors file ({exc})") from None


def _names_and_metadata(file: Path) -> tuple[list[str], dict[str, str] | None]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys()), f.metadata()


def _atomic_file(state: dict[str, torch.Tensor], out: Path, metadata: dict[str, str] | None) -> None:
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp, metadata=metadata)
        os.chmod(tmp, file_mode())  # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_state_like(state: dict[str, torch.Tensor], out: Path, like: Path) -> None:
    """Write `state` to `out` in the same form as `like` (file, or directory with its split), with
    `like`'s safetensors metadata: patched weights of a checkpoint written like the target come out
    byte-identical to it.

    A file is replaced atomically; a directory is built beside `out` and renamed into place, and
    `out` must not exist yet.
    """
    out, like = Path(out), Path(like)
    out.parent.mkdir(parents=True, exist_ok=True)
    if like.is_file():
        _atomic_file(state, out, _names_and_metadata(like)[1])
        return
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new directory for the output")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        for item in like.iterdir():
            if item.suffix != ".safetensors" and item.is_file():
                shutil.copy2(item, tmp / item.name)
        for file in weight_files(like):
            names, metadata = _names_and_metadata(like / file)
            save_file({n: state[n] for n in names}, tmp / file, metadata=metadata)
        umask_modes(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
