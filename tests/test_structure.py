"""The shape of the code base: module and function sizes, no import circle, a short README,
no labels of past measurement runs or issue tags, and every document the code cites exists."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quarl"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_README_LINES = 250
# Triton sources: each kernel with its launcher, kept whole where splitting would scatter one
# kernel family over files (CUDA sources, *.cu / *.cuh, are not Python and not counted)
KERNEL_SOURCES = {
    "quarl/quant/kernels/triton_kernels.py",
    "quarl/rollout/kernels.py",
    "quarl/rollout/fused.py",
    "quarl/learner/kernels.py",
}
# names of past measurement runs and notes entries ("session 48", "run19", "s42", "NOTES entry")
RUN_LABEL = re.compile(r"(?i)\bsessions? \d+|\bNOTES(?:\.md| entr)|(?<![A-Za-z])run[_-]?\d+(?![\d.])|\bs\d{2}\b"
                       r"|must-show")
# the project's issue tags; tensor shapes such as ``[B]`` are written in code spans, which are removed first
ISSUE_TAG = re.compile(r"\[(?:U2|H|M|MK|Z|X2?|B|M2|S)\]")
CODE_SPAN = re.compile(r"``.*?``|`[^`\n]*`", re.S)
CITED_DOC = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md|[A-Z][A-Z_]*\.md)\b")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _prose(path: Path) -> str:
    """A Python file's comments and docstrings (where labels and tags would be written)."""
    source = path.read_text()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts = [tok.string for tok in tokens if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: its body's, and those under a top-level
    ``if`` (``TYPE_CHECKING`` included) or ``try``; not those inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """quarl module -> the quarl modules its top-level imports name (``from pkg import mod``
    names the module ``pkg.mod``, ``from mod import name`` the module ``mod``)."""
    paths = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in paths}
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                deps.add(sub if sub in paths else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_over_600_lines_outside_the_kernel_sources():
    assert all((ROOT / k).is_file() for k in KERNEL_SOURCES)
    long = {_rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
            and _rel(p) not in KERNEL_SOURCES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_circle_among_quarl_modules():
    graph = import_graph()
    assert len(graph) > 100 and "quarl.quant.kernels.tables" in graph["quarl.quant.kernels.dispatch"]
    assert not import_cycles(graph)


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_model_layer_imports_neither_the_engine_nor_the_learner():
    graph = import_graph()
    model = [m for m in graph if m.startswith("quarl.model")]
    assert model and not {d for m in model for d in graph[m] if d.startswith(("quarl.rollout", "quarl.learner"))}


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def _labelled_texts() -> list[tuple[str, str, str]]:
    """(path, text searched for run labels, text searched for issue tags) of the library,
    the README, the docs and the experiment configs."""
    out = [(_rel(p), p.read_text(), _prose(p)) for p in _modules()]
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
              *sorted((ROOT / "experiments").rglob("*.yaml"))]:
        if p.is_file():
            text = p.read_text()
            out.append((_rel(p), text, text))
    return out


def test_no_numbered_run_labels_or_issue_tags():
    found = []
    for path, text, prose in _labelled_texts():
        found += [f"{path}: {m.group()!r}" for m in RUN_LABEL.finditer(text)]
        found += [f"{path}: {m.group()!r}" for m in ISSUE_TAG.finditer(CODE_SPAN.sub("", prose))]
    assert not found, f"labels of past runs or issue tags: {found[:20]} ({len(found)} in all)"


@pytest.mark.parametrize("text,labels,tags", [
    ("measured in session 48 (NOTES entry 3)", 2, 0), ("see gemm_run19_r1.json", 1, 0), ("since s42 the loop", 1, 0),
    ("every run 0.62 -> 0.73, 3 seeds", 0, 0), ("issue [H], must-show 2", 1, 1), ("rewards ``[B]`` and `x [M]`", 0, 0),
])
def test_the_label_patterns(text, labels, tags):
    assert len(RUN_LABEL.findall(text)) == labels
    assert len(ISSUE_TAG.findall(CODE_SPAN.sub("", text))) == tags


def test_every_document_the_code_cites_exists():
    missing = sorted({f"{_rel(p)}: {m}" for p in _modules() for m in CITED_DOC.findall(p.read_text())
                      if not (ROOT / m).is_file()})
    assert not missing, f"cited documents that do not exist: {missing}"
