"""Carry the Python packages sparserl-mcore needs to a GPU box that has no package index.

The target is a bare single-GPU image whose python3 already has torch (CUDA), triton,
transformers, safetensors, pyarrow, rich, psutil, pyyaml, nvidia-ml-py and pytest (`BOX`).
Everything else the project and its GPU checks import is pinned in tools/gpu-wheels.txt:

    python tools/gpu_wheels.py lock                 # rewrite the list from this environment
    python tools/gpu_wheels.py download [--python-version 3.12] [--dest .gpu-wheels]   # here
    python3 tools/gpu_wheels.py install [--wheels .gpu-wheels] [--target .gpu-site]    # there
    python3 tools/gpu_wheels.py check   [--target .gpu-site]                            # there

`lock` takes the run-time dependency closure of sparserl-mcore (plus pytest-timeout) in this
environment, drops whatever the closure of `BOX` already provides, and keeps `ALWAYS` (the HTTP
stack the server and client import, whatever the image's transformers pulls in). `download` fetches
binary wheels for the target interpreter (`pip download --no-deps --only-binary=:all:` for
manylinux x86_64); `install` is `pip install --no-index --no-deps --target`, so nothing is
resolved or fetched on the box; `check` imports every carried module with the target first on
the path. Use it with `PYTHONPATH=.gpu-site:.` (what `make gpu-check` does). Only the standard
library and pip are needed on the box.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

LIST = Path(__file__).with_name("gpu-wheels.txt")
BOX = (
    "torch",
    "triton",
    "transformers",
    "safetensors",
    "pyarrow",
    "rich",
    "psutil",
    "pyyaml",
    "nvidia-ml-py",
    "pytest",
)
ROOTS = ("sparserl-mcore", "pytest-timeout")
# Carried even where this environment's BOX closure has them (a newer transformers pulls typer and
# pydantic in; the image's may not): the HTTP server and client stack.
ALWAYS = (
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "idna",
    "certifi",
    "click",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "annotated-doc",
    "typing-extensions",
)
# distribution -> the module `check` imports (when it differs from the distribution name)
MODULES = {
    "pyyaml": "yaml",
    "python-dateutil": "dateutil",
    "typing-extensions": "typing_extensions",
    "pydantic-core": "pydantic_core",
    "nvidia-ml-py": "pynvml",
    "pillow": "PIL",
    "megatron-core": "megatron.core",
    "pytest-timeout": "pytest_timeout",
    "fonttools": "fontTools",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "annotated-doc": "annotated_doc",
    "opentelemetry-api": "opentelemetry",
}
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_28_x86_64",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str) -> list[str]:
    """Names this installed distribution requires at run time (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(_norm(req.name))
    return out


def _closure(roots: tuple[str, ...]) -> set[str]:
    seen, todo = set(), [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requirements(name))
        except metadata.PackageNotFoundError:
            pass  # not installed here (e.g. triton on a CPU box): nothing below it to follow
    return seen


def carried() -> list[str]:
    """`name==version` of every package the GPU image lacks, as installed in this environment."""
    names = (_closure(ROOTS) - _closure(BOX) - {"sparserl-mcore"}) | set(ALWAYS)
    return sorted(f"{name}=={metadata.version(name)}" for name in names)


def lock(_: argparse.Namespace) -> int:
    lines = carried()
    header = "# written by `python tools/gpu_wheels.py lock`; see its docstring"
    LIST.write_text("\n".join([header, *lines]) + "\n")
    print(f"{LIST}: {len(lines)} packages")
    return 0


def pinned() -> list[str]:
    lines = (line.strip() for line in LIST.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def download(args: argparse.Namespace) -> int:
    version = args.python_version.replace(".", "")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(args.dest),
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        "--abi",
        f"cp{version}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *(f"--platform={p}" for p in PLATFORMS),
        *pinned(),
    ]
    return subprocess.call(cmd)


def install(args: argparse.Namespace) -> int:
    wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.wheels}: `make gpu-wheels` where an index is reachable", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--upgrade",
        "--target",
        str(args.target),
        *wheels,
    ]
    return subprocess.call(cmd)


def check(args: argparse.Namespace) -> int:
    """Import every carried module, the target first on the path; one line per failure."""
    sys.path[:0] = [str(Path(args.target).resolve()), str(Path(__file__).resolve().parents[1])]
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    failed = []
    for name in [_norm(p.split("==")[0]) for p in pinned()] + ["sparserl_mcore.trainer.setup"]:
        module = MODULES.get(name, name.replace("-", "_"))
        try:
            importlib.import_module(module)
        except Exception as exc:  # report every missing piece, not just the first
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    for line in failed:
        print(f"gpu_wheels check: cannot import {line}", file=sys.stderr)
    print(f"gpu_wheels check: {len(pinned()) + 1 - len(failed)} imports ok, {len(failed)} failed")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_wheels.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("lock").set_defaults(fn=lock)
    d = sub.add_parser("download")
    d.add_argument("--python-version", default="3.12")
    d.add_argument("--dest", type=Path, default=Path(".gpu-wheels"))
    d.set_defaults(fn=download)
    i = sub.add_parser("install")
    i.add_argument("--wheels", type=Path, default=Path(".gpu-wheels"))
    i.add_argument("--target", type=Path, default=Path(".gpu-site"))
    i.set_defaults(fn=install)
    c = sub.add_parser("check")
    c.add_argument("--target", type=Path, default=Path(".gpu-site"))
    c.set_defaults(fn=check)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
