"""Test-suite wiring: tests marked `gpu` need CUDA and are skipped, with the reason, without it
(`make gpu-check` runs exactly them, `pytest -m gpu`, on a GPU box)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu; run `make gpu-check` on a GPU box)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
