"""The import graph of ``executor/`` has floors: no circle (an import of a module counts as
one of each package around it too, whose ``__init__`` runs first), ``config`` imports only
``errors``, and the service reaches the executor only through its packages' faces.

Imports are read from the source (module level and inside functions alike: a lazy import
is still a dependency); imports under ``if TYPE_CHECKING:`` are left out, since they never
run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What ``service/`` may import from ``executor``: the packages' faces.
SERVICE_MAY_IMPORT = frozenset({
    "executor", "executor.api", "executor.errors", "executor.config", "executor.distributed",
    "executor.weights", "executor.graphs.registry", "executor.attention"})


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module name an import in ``path`` names (``from a import b`` gives ``a`` and
    ``a.b``), outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for stmt in node.body for n in ast.walk(stmt)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _edges() -> dict[str, set[str]]:
    mods = _modules("executor")
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for target in _imports(path):
            while target and target not in mods:  # an attribute: its module
                target = target.rpartition(".")[0]
            # importing ``a.b.c`` runs the package ``a.b``'s ``__init__`` first: an edge
            # to each enclosing package too (but not to this module's own packages)
            while target:
                if target in mods and target != name and not name.startswith(target + "."):
                    targets.add(target)
                target = target.rpartition(".")[0]
        edges[name] = targets
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_executor_package_has_no_import_circle() -> None:
    assert _circles(_edges()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_is_the_ground_floor() -> None:
    assert _edges()["executor.config"] == {"executor.errors"}


def test_the_service_imports_only_the_executors_faces() -> None:
    executor = _modules("executor")  # (a name that is no module is an attribute of one)
    reached = {(path.name, name) for path in _modules("service").values()
               for name in _imports(path) if name in executor and name not in SERVICE_MAY_IMPORT}
    assert reached == set()
    assert "executor.executor" in executor  # (the check sees private modules)
