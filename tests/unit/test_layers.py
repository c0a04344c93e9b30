"""The import layers of the package and the benchmarks.

NOTE [layers] in ``shmloader/_node/cleanup.py`` states the rule.

Two checks: what a fresh interpreter loads when it imports one module of a
low layer, and the static import graph (every import statement, at module
level, inside functions and under ``TYPE_CHECKING``) of ``shmloader``,
``shmloaderd`` and ``benchmarks``, which must have no circle.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: (directory on sys.path, top-level package) of every tree checked.
TREES = ((REPO, "shmloader"), (REPO / "daemon", "shmloaderd"), (REPO, "benchmarks"))

# ----------------------------------------------------------------- the graph


def modules(trees: tuple[tuple[Path, str], ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of each package."""
    found: dict[str, Path] = {}
    for base, package in trees:
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict[str, Path]
) -> set[str]:
    """The modules of ``known`` an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        dotted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = name.split(".") if is_package else name.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        # ``from base import x``: the module ``base.x``, else a name defined in ``base``
        dotted = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for target in dotted:
        while target and target not in known:  # ``import a.b.c``: the deepest module known
            target = target.rpartition(".")[0]
        if target:
            out.add(target)
    return out


def import_graph(trees: tuple[tuple[Path, str], ...] = TREES) -> dict[str, set[str]]:
    """Module -> the modules of the trees it imports anywhere in its source."""
    known = modules(trees)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                is_package = path.name == "__init__.py"
                graph[name].update(_targets(node, name, is_package, known) - {name})
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def below(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` loads, directly or not."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@functools.cache
def _ours() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_circle() -> None:
    found = circles(_ours())
    assert not found, "import circles: " + "; ".join(", ".join(c) for c in found)


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n    return g\n")
    (pkg / "high.py").write_text("from . import low\n\ng = low\n")
    (pkg / "side.py").write_text("import pkg.low\n")
    graph = import_graph(((tmp_path, "pkg"),))
    assert graph["pkg.side"] == {"pkg.low"}
    assert circles(graph) == [["pkg.high", "pkg.low"]]


def test_the_registry_and_the_shared_memory_layer_import_nothing_above_them() -> None:
    graph = _ours()
    assert graph["shmloader._node.cleanup"] <= {"shmloader.errors"}
    above = {
        "shmloader._node.inventory",
        "shmloader._transport.daemon_client",
        "shmloader._node.reaping",
        "shmloader.tools.stat",
    }
    for module in (
        "shmloader._node.segment",
        "shmloader._transport.channel",
        "shmloader._node.ring",
    ):
        assert not below(graph, module) & above, module
    assert "shmloader._transport.channel" not in below(graph, "shmloader._node.segment")
    assert "shmloader._node.ring" not in below(graph, "shmloader._transport.channel")


# --------------------------------------------------- what an import loads


def _loaded(module: str) -> set[str]:
    """The modules of ours a fresh interpreter holds after ``import module``."""
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('shmloader', 'shmloaderd', 'benchmarks'))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "daemon")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


ABOVE_NODE = {
    "shmloader._node.inventory",
    "shmloader._transport.daemon_client",
    "shmloader._node.reaping",
    "shmloader.tools.stat",
}


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        (
            "shmloader",
            {
                "shmloader._node.inventory",
                "shmloader._transport.daemon_client",
                "shmloader._node.reaping",
                "shmloader.tools.stat",
                "shmloader.loader",
            },
        ),
        (
            "shmloader._node.segment",
            {
                "shmloader._node.inventory",
                "shmloader._transport.channel",
                "shmloader._transport.daemon_client",
                "shmloader._node.reaping",
                "shmloader.tools.stat",
                "shmloader._node.ring",
            },
        ),
        (
            "shmloader._node.ring",
            {
                "shmloader._node.inventory",
                "shmloader._transport.daemon_client",
                "shmloader._node.reaping",
                "shmloader.tools.stat",
            },
        ),
        (
            "shmloader._transport.channel",
            {
                "shmloader._node.inventory",
                "shmloader._transport.daemon_client",
                "shmloader._node.reaping",
                "shmloader.tools.stat",
            },
        ),
    ],
)
def test_a_low_layer_loads_nothing_above_it(module: str, absent: set[str]) -> None:
    loaded = _loaded(module)
    assert module in loaded
    assert not loaded & absent, sorted(loaded & absent)
    assert not {m for m in loaded if m.split(".")[0] == "shmloaderd"}
