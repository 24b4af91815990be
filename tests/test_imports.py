"""No import cycles inside the quarl package (imports inside functions count too)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "quarl"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> quarl modules it imports`` (``from a import b`` counts as a.b when that is a
    module, else a), from the source with ast."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        is_pkg = path.name == "__init__.py"
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        # a package's __init__ is not a dependency of its own submodules' cycle check
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_quant_has_no_import_cycle():
    graph = import_graph()
    assert "quarl.quant.kernels.launch" in graph and graph["quarl.quant.kernels.launch"]
    quant = {m: {d for d in deps if d.startswith("quarl.quant")}
             for m, deps in graph.items() if m.startswith("quarl.quant")}
    cycle = find_cycle(quant)
    assert cycle is None, " -> ".join(cycle)


def test_quarl_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_type_checking_imports_are_not_edges(tmp_path):
    pkg = tmp_path / "quarl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quarl.b import X\n")
    (pkg / "b.py").write_text("def f():\n    from quarl import a\n")
    assert import_graph(pkg) == {"quarl": set(), "quarl.a": set(), "quarl.b": {"quarl.a"}}
