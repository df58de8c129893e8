"""Shared pytest setup: the repo root is importable, and the `gpu` marker is registered."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # plain `pytest` (not `python -m pytest`) from any cwd
    sys.path.insert(0, str(REPO))


def pytest_configure(config):
    # Registered so `-m "not gpu"` selects the CPU suite and --strict-markers accepts the marker.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu/, run on an accelerator)")


def pytest_collection_modifyitems(config, items):
    """GPU tests are collected everywhere and skipped, with the reason, where CUDA is absent."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run tests/gpu/run_all.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
