"""The shape of the Python package: its modules import each other without a
cycle (data_parallel -> schedules -> replica, never back), and the schedules
touch no private member of the wrapper."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "hemiola"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: compiled modules of the package (no source here; they import nothing of it)
EXTENSIONS = {"hemiola._C"}


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that `path` imports, anywhere in it (functions
    and ``if TYPE_CHECKING:`` blocks included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    modules = _modules()
    known = set(modules) | EXTENSIONS
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    graph.update({name: set() for name in EXTENSIONS})
    assert graph["hemiola.data_parallel"], "the import graph found nothing: is the parser wrong?"
    assert "hemiola.schedules" in graph["hemiola.data_parallel"]
    assert _cycles(graph) == [], "modules that import each other (directly or through others)"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_schedules_never_see_the_wrapper() -> None:
    """Schedules work on a Replica: they neither import nor name the wrapper,
    and read no private member of the replica (``replica._x``)."""
    offending = []
    for path in sorted((PACKAGE / "schedules").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and "data_parallel" in (node.module or ""):
                offending.append(f"{where}: imports {node.module}")
            if isinstance(node, ast.Name) and node.id in ("model", "DataParallel"):
                offending.append(f"{where}: {node.id}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                owner = node.value
                replica = (isinstance(owner, ast.Name) and owner.id in ("replica", "m")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "replica")
                if replica:
                    offending.append(f"{where}: .{node.attr} of the replica")
    assert offending == []
