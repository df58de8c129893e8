"""Checks on the tests themselves: patterns that pass alone and break other tests later in the run.

pytest's monkeypatch must not patch torch's config modules (`torch._dynamo.config`,
`torch._inductor.config`, ...). Those modules keep their values behind `__getattr__`, so
monkeypatch (pytest >= 9.2) records "no instance attribute" and its undo *deletes* the key, which a
config module implements by hiding it: every later read raises AttributeError. That is how
test_plan's `monkeypatch.setattr(torch._dynamo.config, "disable", False)` broke four tests in
test_step.py (megatron's compiled SwiGLU reads the flag). torch's own `config.patch(...)` restores
the previous value instead.

Also: `.ci/run` runs exactly the README's test command, and constraints-cpu.txt pins every
requirement of pyproject.toml (with its `test` extra) inside pyproject's range.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# torch.<anything>.config / torch.<anything>._config: torch's ConfigModule instances
_TORCH_CONFIG = re.compile(r"^torch(\.\w+)*\._?config$")
_FIX = (
    "use torch's own patch, which restores the value: `with torch._dynamo.config.patch(disable=False):` "
    "(or `@torch._dynamo.config.patch(...)` on the test); pytest's monkeypatch deletes the key on undo "
    "and hides it from every later test"
)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted module path, from every import in the file (functions' included)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:  # `import torch._dynamo.config` binds `torch`
                    head = a.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(expr: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(aliases.get(expr.id, expr.id))
    return ".".join(reversed(parts))


def torch_config_monkeypatches(source: str, filename: str = "<string>") -> list[str]:
    """`<x>.setattr(...)` / `<x>.delattr(...)` calls (monkeypatch, MonkeyPatch.context()'s `m`, ...)
    whose target is a torch config module, as "file:line: code"."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and node.args
        ):
            continue
        target = node.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            # the dotted-string form: monkeypatch.setattr("torch._dynamo.config.disable", False)
            name = target.value.rsplit(".", 1)[0]
        else:
            name = _dotted(target, aliases)
        if name and _TORCH_CONFIG.match(name):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_monkeypatches_a_torch_config_module():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        offenders += torch_config_monkeypatches(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not offenders, "pytest's monkeypatch on a torch config module:\n  " + "\n  ".join(offenders) + "\n" + _FIX


def test_the_check_finds_each_spelling():
    bad = {
        "monkeypatch.setattr(torch._dynamo.config, 'disable', False)",
        "monkeypatch.delattr(torch._inductor.config, 'max_autotune')",
        "mp.setattr(torch._functorch.config, 'donated_buffer', False)",
        "monkeypatch.setattr(torch.fx.experimental._config, 'x', 1)",
        "monkeypatch.setattr('torch._dynamo.config.disable', False)",
        "monkeypatch.delattr('torch._dynamo.config.disable')",
    }
    src = "import torch\n" + "\n".join(sorted(bad))
    assert len(torch_config_monkeypatches(src)) == len(bad)
    aliased = (
        "from torch._dynamo import config as dcfg\nimport torch._inductor.config as icfg\n"
        "from torch._functorch import config\n"
        "def test(monkeypatch):\n"
        "    with monkeypatch.context() as m:\n        m.setattr(dcfg, 'disable', False)\n"
        "    monkeypatch.setattr(icfg, 'a', 1)\n    monkeypatch.setattr(config, 'b', 1)\n"
    )
    assert len(torch_config_monkeypatches(aliased)) == 3
    good = (
        "import torch\nfrom moe_sft.layers import attention\n"
        "monkeypatch.setattr(attention, 'flash_attn_varlen_func', None)\n"
        "monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)\n"
        "monkeypatch.setattr(cfg.config, 'x', 1)\n"  # not torch's
        "setattr(torch._dynamo.config, 'disable', True)\n"  # a plain setattr is not undone
        "with torch._dynamo.config.patch(disable=False):\n    pass\n"
    )
    assert torch_config_monkeypatches(good) == []


def test_ci_runs_the_readme_test_command_with_the_pinned_versions():
    import tomllib

    from packaging.requirements import Requirement

    root = TESTS.parent
    readme = (root / "README.md").read_text()
    tests_section = readme[readme.index("## Tests") :]
    command = re.search(r"```bash\n(.+?)\n```", tests_section).group(1)
    assert "-c constraints-cpu.txt" in command and command.endswith("python -m pytest tests -n 2")
    ci = [ln for ln in (root / ".ci/run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == [command], "`.ci/run` must run exactly the README's test command"

    pins = {}
    for line in (root / "constraints-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in constraints-cpu.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints-cpu.txt pins {name}=={pins[name]}, outside pyproject's {spec!r}"
        )
