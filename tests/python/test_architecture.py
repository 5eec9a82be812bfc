"""The shape of the Python package: its modules stand on floors and import
only from their own floor or below, without a cycle (data_parallel ->
schedules -> bound_model, never back), and the schedules touch no private member
of the wrapper. The benchmark package (bench/hemiola/bench, installed as
hemiola.bench) is part of the walk."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "hemiola"
BENCH = ROOT / "bench" / "hemiola" / "bench"

#: The floors of the package, bottom up: a module may import modules of its
#: own floor and the floors below (matched by name or package prefix, but
#: the facade, ``hemiola`` itself, by name only; the first match wins, so a
#: specific name goes before its package's prefix).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("hemiola._C", "hemiola._native", "hemiola.config", "hemiola.comm_hooks",
                "hemiola.torch_sqrt", "hemiola.deferred_norm", "hemiola.forward_gate",
                "hemiola.hooks", "hemiola.cluster.config", "hemiola.ps.config",
                "hemiola.ps.ahead", "hemiola.streaming_shape", "hemiola.replica_groups",
                "hemiola.elastic.protocol")),
    ("services", ("hemiola.engine_tensors", "hemiola.timeline", "hemiola.hyper",
                  "hemiola.distributed", "hemiola.validate", "hemiola.threads",
                  "hemiola.streaming_checkpoint", "hemiola.elastic")),
    ("bound model", ("hemiola.bound_model",)),
    ("schedules", ("hemiola.schedules",)),
    ("wrappers", ("hemiola.data_parallel", "hemiola.streaming")),
    ("wrap", ("hemiola.wrapping", "hemiola.clipping")),
    ("peers and frameworks", ("hemiola.ps", "hemiola.cluster", "hemiola.lightning",
                              "hemiola.hf", "hemiola.launch")),
    ("facade", ("hemiola",)),
    ("applications", ("hemiola.advise", "hemiola.demo", "hemiola.bench", "hemiola.cli",
                      "hemiola.__main__")),
]


def _floor(module: str) -> int:
    for level, (_, names) in enumerate(FLOORS):
        if any(module == n or (n != "hemiola" and module.startswith(n + ".")) for n in names):
            return level
    raise AssertionError(f"{module} stands on no floor: add it to FLOORS")


def _module_name(path: Path) -> str:
    anchor = BENCH.parent.parent if path.is_relative_to(BENCH) else PACKAGE.parent
    parts = path.relative_to(anchor).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: compiled modules of the package (no source here; they import nothing of it)
EXTENSIONS = {"hemiola._C"}


def _modules() -> dict[str, Path]:
    paths = [*PACKAGE.rglob("*.py"), *BENCH.rglob("*.py")]
    return {_module_name(p): p for p in paths if not p.is_symlink()}


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


def test_no_module_imports_a_floor_above_its_own() -> None:
    modules = _modules()
    assert "hemiola.bench.speed" in modules, "the benchmark package is not walked"
    known = set(modules) | EXTENSIONS
    upward = []
    for name, path in sorted(modules.items()):
        for imported in sorted(_imports(path, name, known)):
            if _floor(imported) > _floor(name):
                upward.append(f"{name} ({FLOORS[_floor(name)][0]}) imports {imported} "
                              f"({FLOORS[_floor(imported)][0]})")
    assert upward == []


def test_the_floor_rule_catches_an_upward_import() -> None:
    assert _floor("hemiola.schedules.wfbp") < _floor("hemiola.data_parallel")
    assert _floor("hemiola.engine_tensors") < _floor("hemiola.bound_model")
    assert _floor("hemiola.bench.tasks.runner") == len(FLOORS) - 1


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_schedules_never_see_the_wrapper() -> None:
    """Schedules work on a BoundModel: they neither import nor name the wrapper,
    and read no private member of the bound model (``bound._x``)."""
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
                bound = (isinstance(owner, ast.Name) and owner.id in ("bound", "m")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "bound")
                if bound:
                    offending.append(f"{where}: .{node.attr} of the bound model")
    assert offending == []
