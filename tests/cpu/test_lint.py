"""ruff (lint and format) and import-linter over the repository, as CI runs them through pytest.

Settings live in pyproject.toml ([tool.ruff], [tool.importlinter]); the same checks run before a
commit through .pre-commit-config.yaml. The tools are the ones installed next to this Python (the
`test` extra pins them), run from the repository root.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The project's Python, named: a virtual environment or build tree that CI or a user keeps inside
# the checkout (under any name) is not linted.
SOURCES = ("moe_sft", "tests", "tools", "benchmarks")


def _run(tool: str, *args: str) -> None:
    exe = BIN / tool
    assert exe.is_file(), f"{exe} not found: install the test extra (pip install -e '.[test]')"
    proc = subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"`{tool} {' '.join(args)}` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}", pytrace=False)


@pytest.mark.parametrize("args", [("check",), ("format", "--check")], ids=["check", "format"])
def test_ruff(args):
    """Fix locally with `ruff check --fix . && ruff format .`."""
    _run("ruff", *args, *SOURCES)


def test_import_layers():
    """The layer and forbidden-import contracts of pyproject.toml ([tool.importlinter])."""
    _run("lint-imports")
