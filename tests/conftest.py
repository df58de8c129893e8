"""Shared pytest setup: the repo root is importable, the `gpu` marker is registered, and a test that
hides torch._dynamo.config.disable fails by name."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # plain `pytest` (not `python -m pytest`) from any cwd
    sys.path.insert(0, str(REPO))


# pytest-randomly (the `test` extra) shuffles the test order; this seed makes the shuffle the same on
# every run unless `--randomly-seed=N` (or `last`) says otherwise. Set here, not in pyproject's
# addopts: there `--randomly-seed` breaks `-p no:randomly` ("unrecognized arguments") and `-p randomly`
# breaks pytest wherever the plugin is not installed (a GPU machine with plain pytest).
RANDOM_ORDER_SEED = 1234


@pytest.hookimpl(tryfirst=True)  # before pytest-randomly's own pytest_configure draws a seed
def pytest_configure(config):
    # Registered so `-m "not gpu"` selects the CPU suite and --strict-markers accepts the marker.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu/, run on an accelerator)")
    if config.pluginmanager.hasplugin("randomly") and config.getoption("randomly_seed", "default") == "default":
        config.option.randomly_seed = RANDOM_ORDER_SEED


def pytest_collection_modifyitems(config, items):
    """GPU tests are collected everywhere and skipped, with the reason, where CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run tests/gpu/run_all.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _dynamo_disable_flag_survives():
    """Fails the test (at teardown) that leaves `torch._dynamo.config.disable` unreadable, e.g. by
    pytest's monkeypatch, whose undo deletes a config key and so hides it (megatron's compiled
    functions read it: AttributeError in whichever test runs next). Costs a getattr per test, and
    nothing where torch._dynamo was never imported. tests/cpu/test_test_hygiene.py finds the cause."""
    config = sys.modules.get("torch._dynamo.config")
    before = getattr(config, "disable", None)
    yield
    config = sys.modules.get("torch._dynamo.config")
    if config is None or hasattr(config, "disable"):
        return
    if before is not None:
        config.disable = before  # the tests after this one see the value it found
    pytest.fail(
        "this test left torch._dynamo.config.disable deleted (hidden); patch torch configs with "
        "`with torch._dynamo.config.patch(disable=...)`, not pytest's monkeypatch",
        pytrace=False,
    )
