"""The import layers of the package, the daemon and the benchmarks.

NOTE [layers] in ``shmloader/_node/cleanup.py`` states the rule.

Checked on the static import graph (every import statement, at module level,
inside functions and under ``TYPE_CHECKING``) of ``shmloader``, ``shmloaderd``
and ``benchmarks``: no circle; the layer order ``LAYERS``, each package (or
top-level module) of ``shmloader`` importing only its own layer and those
below (the exceptions in ``UPWARD``, each with its reason); ``_node`` and
``_proto`` independent of each other; ``tools`` imported by ``__main__``
alone; the daemon and the benchmarks importing only what ``DAEMON_MAY`` and
``BENCHMARKS_MAY`` allow. And what a fresh interpreter loads when it imports
one module of a low layer.
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


#: The layers of ``shmloader``, from the ground up (NOTE [layers]): each package or
#: top-level module (``__init__``: the package itself) -> its layer. A module imports
#: modules of its own layer or below, never above.
LAYERS = {
    "errors": 0,
    "_node": 1,  # segments, rings, the ring directory, the SIGTERM registry
    "_proto": 1,  # pure formats: codec, wire, waits
    "mesh": 1,  # pure: a DeviceMesh or group -> the SP group, DP topology
    "config": 2,
    "_rng": 2,  # the default generators: draws counted and mirrored, captured, restored
    "samplers": 2,  # the user's samplers: over mesh, nothing of the loader's
    "_transport": 3,
    "_workers": 4,
    "device": 4,
    "_topology": 4,  # who is where: node identity, the group's roles, the set-up exchange
    "_roles": 5,
    "_setup": 6,
    "loader": 7,
    "checkpoint": 7,
    "__init__": 8,  # the public names (lazily: loader, samplers, mesh)
    "integrations": 8,  # on top of the loader, as a user's code is
    "tools": 9,  # the CLI and the demo
    "__main__": 10,  # python -m shmloader: the CLI
}

#: Packages of one layer that import nothing of each other.
INDEPENDENT = (("_node", "_proto"), ("_workers", "device"))

#: The imports that go up a layer today, each with why it is there (and what would end it).
UPWARD = {
    ("shmloader._roles.local", "shmloader._setup.arrival"): (
        "Local keeps the set-up's Arrival to look for peers once more at its first iteration "
        "(NOTE [set-up marks]); only as a type: a protocol in _roles.base would end it"
    ),
}

#: What the daemon may import of ``shmloader``: the layers it shares with the library
#: (segments, the reaping rule, the waits histogram, the client's protocol, the rule
#: that finds the well-known socket in ``config``, the version in the package root),
#: none of which loads torch (``test_the_daemon_loads_no_torch``).
DAEMON_MAY = {"errors", "_node", "_proto", "_transport", "config", "__init__"}
#: The benchmarks measure the package, its internals included, but not its CLI.
BENCHMARKS_MAY = set(LAYERS) - {"tools", "__main__"}
#: The modules of ``shmloader`` that may import the daemon: ``shmloader daemon``.
IMPORT_THE_DAEMON = {"shmloader.tools.cli"}


def layer_key(module: str, package: str = "shmloader") -> str:
    """The entry of ``LAYERS`` a module of ``package`` belongs to."""
    parts = module.split(".")
    assert parts[0] == package, module
    return parts[1] if len(parts) > 1 else "__init__"


def upward(
    graph: dict[str, set[str]], layers: dict[str, int], package: str = "shmloader"
) -> set[tuple[str, str]]:
    """Every import (importer, imported) of ``package`` from a lower layer to a higher one."""
    inside = {m for m in graph if m.split(".")[0] == package}
    return {
        (a, b)
        for a in inside
        for b in graph[a]
        if b in inside and layers[layer_key(b, package)] > layers[layer_key(a, package)]
    }


def _edges(graph: dict[str, set[str]], src: str, dst: str) -> set[tuple[str, str]]:
    """The imports from modules of the tree ``src`` into modules of the tree ``dst``."""
    return {
        (a, b)
        for a, targets in graph.items()
        if a.split(".")[0] == src
        for b in targets
        if b.split(".")[0] == dst
    }


def test_every_package_has_a_layer() -> None:
    keys = {layer_key(m) for m in _ours() if m.split(".")[0] == "shmloader"}
    assert keys == set(LAYERS), f"place these in LAYERS: {sorted(keys - set(LAYERS))}; " + (
        f"gone: {sorted(set(LAYERS) - keys)}"
    )


def test_no_module_imports_a_higher_layer() -> None:
    found = upward(_ours(), LAYERS) - set(UPWARD)
    assert not found, "imports of a higher layer: " + "; ".join(
        f"{a} ({LAYERS[layer_key(a)]}) -> {b} ({LAYERS[layer_key(b)]})" for a, b in sorted(found)
    )


def test_each_allowed_upward_import_is_still_there() -> None:
    stale = set(UPWARD) - upward(_ours(), LAYERS)
    assert not stale, f"no longer imported (or no longer upward): drop from UPWARD: {stale}"


def test_the_checker_sees_an_upward_import(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import g\n    return g\n")
    (pkg / "high.py").write_text("from .low import a\n\ng = a\n")
    graph = import_graph(((tmp_path, "pkg"),))
    layers = {"__init__": 2, "low": 0, "high": 1}
    assert upward(graph, layers, "pkg") == {("pkg.low.a", "pkg.high")}


@pytest.mark.parametrize(("one", "other"), INDEPENDENT)
def test_packages_of_one_layer_that_import_nothing_of_each_other(one: str, other: str) -> None:
    assert LAYERS[one] == LAYERS[other]
    inside = _edges(_ours(), "shmloader", "shmloader")
    for a, b in ((one, other), (other, one)):
        found = {(m, t) for m, t in inside if (layer_key(m), layer_key(t)) == (a, b)}
        assert not found, f"{a} imports {b}: {sorted(found)}"


def test_only_main_imports_tools() -> None:
    graph = _ours()
    importers = {
        a
        for a, b in _edges(graph, "shmloader", "shmloader")
        if layer_key(b) == "tools" and layer_key(a) != "tools"
    }
    assert importers == {"shmloader.__main__"}
    for tree in ("shmloaderd", "benchmarks"):
        assert not {b for _, b in _edges(graph, tree, "shmloader") if layer_key(b) == "tools"}


def test_the_daemon_imports_only_what_it_may() -> None:
    graph = _ours()
    found = _edges(graph, "shmloaderd", "shmloader")
    assert found, "the daemon imports the library's segments: the graph lost them"
    refused = {(a, b) for a, b in found if layer_key(b) not in DAEMON_MAY}
    assert not refused, sorted(refused)
    assert not _edges(graph, "shmloaderd", "benchmarks")
    assert {a for a, _ in _edges(graph, "shmloader", "shmloaderd")} <= IMPORT_THE_DAEMON


def test_the_daemon_loads_no_torch() -> None:
    """What the daemon imports of the library never brings torch into its process."""
    code = "import sys, shmloaderd.__main__; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False", out


def test_the_benchmarks_import_only_what_they_may() -> None:
    graph = _ours()
    found = _edges(graph, "benchmarks", "shmloader")
    assert found
    refused = {(a, b) for a, b in found if layer_key(b) not in BENCHMARKS_MAY}
    assert not refused, sorted(refused)
    assert not _edges(graph, "benchmarks", "shmloaderd")
    assert not _edges(graph, "shmloader", "benchmarks")


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


#: The daemon's client and what asks it (``stat``/``gc``, the reaping at start): above
#: segments, rings and channels, whatever their folders (``UPWARD``).
DAEMON_AND_STAT = {
    "shmloader._node.inventory",
    "shmloader._transport.daemon_client",
    "shmloader._node.reaping",
    "shmloader.tools.stat",
}


def test_the_registry_and_the_shared_memory_layer_import_nothing_above_them() -> None:
    graph = _ours()
    assert graph["shmloader._node.cleanup"] <= {"shmloader.errors"}
    for module in (
        "shmloader._node.segment",
        "shmloader._transport.channel",
        "shmloader._node.ring",
    ):
        assert not below(graph, module) & DAEMON_AND_STAT, module
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


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("shmloader", {*DAEMON_AND_STAT, "shmloader.loader"}),
        (
            "shmloader._node.segment",
            {*DAEMON_AND_STAT, "shmloader._transport.channel", "shmloader._node.ring"},
        ),
        ("shmloader._node.ring", DAEMON_AND_STAT),
        ("shmloader._transport.channel", DAEMON_AND_STAT),
    ],
)
def test_a_low_layer_loads_nothing_above_it(module: str, absent: set[str]) -> None:
    loaded = _loaded(module)
    assert module in loaded
    assert not loaded & absent, sorted(loaded & absent)
    assert not {m for m in loaded if m.split(".")[0] == "shmloaderd"}
