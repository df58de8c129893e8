"""No import cycles in moe_sft/: an AST scan of module-level and function-level imports."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moe_sft"

# Cycles outside moe_sft/conversion/ that other work (issue 26, parts 1 and 2) removes. Listed so
# that a new cycle fails this test; delete an entry when its cycle is gone.
KNOWN_CYCLES_OUTSIDE_CONVERSION = [
    # runtime/compat.py installs trainer/optimizer_kernels' fused Adam (issue 26, part 2)
    ["moe_sft.runtime.compat", "moe_sft.runtime.device", "moe_sft.trainer.adam_kernel",
     "moe_sft.trainer.optimizer_kernels"],
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


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


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
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


def test_no_import_cycle_in_conversion():
    found = [c for c in cycles(import_graph()) if any(m.startswith("moe_sft.conversion") for m in c)]
    assert not found, "import cycles through moe_sft/conversion:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_new_import_cycle_elsewhere():
    found = [c for c in cycles(import_graph()) if not any(m.startswith("moe_sft.conversion") for m in c)]
    known = sorted(sorted(c) for c in KNOWN_CYCLES_OUTSIDE_CONVERSION)
    new = [c for c in found if c not in known]
    assert not new, "new import cycles in moe_sft/:\n" + "\n".join(" <-> ".join(c) for c in new)
