"""Shared test set-up: `gpu`-marked tests skip cleanly on machines without CUDA; CI's property
tests draw the same examples every run (HYPOTHESIS_PROFILE=ci, set by .ci/run), so a build
fails for a change, not for a draw; run without it, they explore new examples each time."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
