"""model.backend: `auto` is the torch-native spec even where Transformer Engine imports; `te` is an
explicit opt-in whose startup line says it is not validated by moe-sft's tests."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # plain `pytest` (not `python -m pytest`) from anywhere
    sys.path.insert(0, str(REPO))

from moe_sft.runtime.device import choose_runtime  # noqa: E402

NOT_VALIDATED = "Transformer Engine spec: not validated by moe-sft's tests; the torch-native path is the tested one"


def _forget_te() -> None:
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]


@pytest.fixture
def fake_te(tmp_path, monkeypatch):
    """An importable `transformer_engine` (with `.pytorch`) and a CUDA device, as on a GPU node with
    TE installed; removed again afterwards so no other test sees it."""
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text("")
    _forget_te()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield
    _forget_te()


def test_fake_te_imports(fake_te):
    import transformer_engine.pytorch  # noqa: F401


def test_auto_is_the_torch_native_path_even_where_te_imports(fake_te):
    choice = choose_runtime(backend="auto")
    assert (choice.device, choice.backend) == ("cuda", "torch")
    assert NOT_VALIDATED not in choice.describe()


def test_te_is_an_explicit_opt_in_and_says_it_is_not_validated(fake_te):
    choice = choose_runtime(backend="te")
    assert (choice.device, choice.backend) == ("cuda", "te")
    assert NOT_VALIDATED in choice.reasons
    assert NOT_VALIDATED in choice.describe()  # the trainer's startup line


def test_auto_without_te_or_cuda_is_torch():
    choice = choose_runtime(backend="auto")
    assert choice.backend == "torch"


def test_te_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, on any machine
    with pytest.raises(RuntimeError, match="model.backend=te"):
        choose_runtime(backend="te")


def test_te_not_installed_is_a_preflight_error_naming_the_field_and_the_fix(monkeypatch):
    """Before the model or a process group: the config validation, not a traceback at startup."""
    import importlib.util

    from moe_sft.config import ConfigError
    from moe_sft.config.load import load_recipe
    from moe_sft.config.validate import validate_config

    cfg = load_recipe(str(REPO / "recipes" / "quickstart.yaml"))
    cfg.model.backend, cfg.trainer.device = "te", "auto"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformer_engine" else real(n, *a))
    with pytest.raises(
        ConfigError, match=r"model\.backend='te' but transformer_engine is not installed.*model\.backend=torch"
    ):
        validate_config(cfg, 1)


def test_te_installed_passes_the_preflight(fake_te):
    from moe_sft.config.load import load_recipe
    from moe_sft.config.validate import check_model_paths

    cfg = load_recipe(str(REPO / "recipes" / "quickstart.yaml"))
    cfg.model.backend, cfg.trainer.device = "te", "auto"
    assert not any("transformer_engine" in e for e in check_model_paths(cfg, 1))
