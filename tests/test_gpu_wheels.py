"""tools/gpu-wheels.txt (what `make gpu-wheels` carries to a GPU box without an index) stays the
dependency closure of this project minus what the GPU image provides, pinned to the versions this
environment tests: a dependency added to pyproject.toml without re-running `lock` fails here."""

from __future__ import annotations

from tools import gpu_wheels


def test_the_carried_list_is_this_environments_closure_minus_the_image():
    assert gpu_wheels.pinned() == gpu_wheels.carried(), "run `python tools/gpu_wheels.py lock`"


def test_the_server_stack_and_megatron_are_carried():
    names = {line.split("==")[0] for line in gpu_wheels.pinned()}
    assert {
        "megatron-core",
        "zstandard",
        "xxhash",
        "fastapi",
        "uvicorn",
        "starlette",
        "pydantic",
        "httpx",
    } <= names
    assert not names & {"torch", "transformers", "numpy", "pytest"}  # the image's own
