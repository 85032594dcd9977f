"""The package's import graph: no cycle between files, and no import from a lower layer into a
higher one (kernels < models < engine < api < cluster; a top-level module sits just above the
highest layer it imports, ground where it imports none). Every import counts: module level,
inside functions, under TYPE_CHECKING; a package's __init__ importing its own children is its
face, not an arrow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "probserve"
RANK = {"kernels": 0, "models": 1, "engine": 2, "api": 3, "cluster": 4}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("probserve") and target != name:
                    targets.add(target)
        # a package's __init__ importing its own children is its face, not an arrow between rooms
        graph[name] = {t for t in targets if not t.startswith(name + ".")}
    return graph


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(name: str, graph: dict[str, set[str]], seen: frozenset[str] = frozenset()) -> int:
    parts = name.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK):
        return RANK.get(parts[1], -1)
    if name in seen:
        return -1
    below = [_rank(t, graph, seen | {name}) for t in graph.get(name, ())]
    return max(below, default=-1) + 0.5  # type: ignore[return-value]


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_upward_imports():
    graph = _graph()
    upward = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _rank(b, graph) > _rank(a, graph) and _layer(a) != _layer(b)
    ]
    assert upward == []


# the modules the API process imports to serve (its faces of engine/ and models/ included)
API_PROCESS = (
    "probserve.cli",
    "probserve.serving",
    "probserve.settings",
    "probserve.api.app",
    "probserve.engine.client",
    "probserve.engine.worker_client",
    "probserve.models.loader",
)


@pytest.mark.slow
def test_the_api_process_loads_no_torch() -> None:
    """ARCHITECTURE.md: the API process never loads torch (nor transformers' modeling code):
    importing what it serves with, in a fresh interpreter, leaves both out of sys.modules."""
    code = (
        "import importlib, sys\n"
        f"for name in {API_PROCESS!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
