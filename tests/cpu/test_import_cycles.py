"""No import cycles anywhere in moe_sft/: an AST scan of module-level and function-level imports.

Function-level (deferred) imports count: they hide a cycle from Python's import machinery but not
from the design (docs/design.md: nothing imports upward, no import cycles). There is no list
of allowed cycles; break a cycle by moving the shared piece into the lower module.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / "moe_sft").rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The moe_sft module `name` refers to (a package's attribute resolves to the package)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every moe_sft module that `module` imports anywhere in its body (not only at top level)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if not target.startswith("moe_sft"):
                continue
            resolved = _resolve(target, modules)
            if resolved and resolved != module:
                found.add(resolved)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    """A cycle and the imports that close it (importer -> imported, both inside the cycle)."""
    members = set(cycle)
    edges = [f"    {a} -> {b}" for a in cycle for b in sorted(graph[a] & members)]
    return " <-> ".join(cycle) + "\n" + "\n".join(edges)


def test_cycle_finder_sees_function_level_imports(tmp_path):
    """The scan itself: a cycle closed by an import inside a function is found."""
    pkg = tmp_path / "moe_sft"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from moe_sft import b\n")
    (pkg / "b.py").write_text("def f():\n    from moe_sft.a import g\n")
    (pkg / "c.py").write_text("import moe_sft.a\n")
    assert cycles(import_graph(tmp_path)) == [["moe_sft.a", "moe_sft.b"]]


def test_no_import_cycle_in_moe_sft():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in moe_sft/:\n" + "\n".join(_describe(c, graph) for c in found)
