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
