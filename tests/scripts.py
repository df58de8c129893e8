"""Load a repository script (tools/*.py, benchmarks/*.py) as a module, to call its main() in-process."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, module_name: str | None = None):
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(module_name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tool(script: str):
    """tools/<script>."""
    return load_script(f"tools/{script}")
