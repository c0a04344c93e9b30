"""The public surface of ``shmloader``: ``__all__``, what it resolves to, the exception tree.

Changing any of these changes the public API: the lists below say it first.
"""

from __future__ import annotations

import inspect
import tomllib
import types
from pathlib import Path

import pytest

import shmloader
from shmloader import errors

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)

#: ``shmloader.__all__``, in its order.
EXPORTED = [
    "BalancedBatchSampler",
    "Config",
    "ConfigError",
    "ConfigMismatchError",
    "DivergenceError",
    "LeaderError",
    "LeaderStoppedError",
    "LoaderStateError",
    "PeerLostError",
    "ProtocolError",
    "ShardedBatchSampler",
    "ShardedSampler",
    "ShmCapacityError",
    "ShmLoader",
    "ShmLoaderError",
    "TopologyMismatchError",
    "UnsupportedBatchError",
    "dp_topology",
    "dp_topology_from_group",
]

#: Public-looking names of the package's namespace that are its own imports, not API.
NOT_EXPORTED = {"annotations", "importlib", "Any", "TYPE_CHECKING"}

#: Every exception of ``shmloader.errors`` -> its bases (what a user's ``except`` catches).
EXCEPTION_TREE = {
    "ShmLoaderError": ("Exception",),
    "ConfigError": ("ShmLoaderError", "ValueError"),
    "ConfigMismatchError": ("ConfigError",),
    "UnsupportedBatchError": ("ShmLoaderError", "TypeError"),
    "LeaderError": ("ShmLoaderError",),
    "PeerLostError": ("ShmLoaderError",),
    "LeaderStoppedError": ("LeaderError",),
    "DivergenceError": ("ShmLoaderError",),
    "ShmCapacityError": ("ShmLoaderError", "MemoryError"),
    "TopologyMismatchError": ("ShmLoaderError", "ValueError"),
    "LoaderStateError": ("ShmLoaderError", "RuntimeError"),
    "ProtocolError": ("ShmLoaderError",),
}


def _exceptions() -> dict[str, type[BaseException]]:
    """The exception classes ``shmloader.errors`` defines."""
    return {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls)
        and issubclass(cls, BaseException)
        and cls.__module__ == errors.__name__
    }


def test_all_is_the_written_list() -> None:
    assert shmloader.__all__ == EXPORTED


def test_every_exported_name_resolves_to_an_object_of_the_package() -> None:
    for name in shmloader.__all__:
        value = getattr(shmloader, name)  # the lazy ones (PEP 562) import their module here
        module = getattr(value, "__module__", "")
        assert module.split(".")[0] == "shmloader", (name, module)
    namespace: dict[str, object] = {}
    exec("from shmloader import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(EXPORTED)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        shmloader.Nope  # noqa: B018


def test_no_public_name_is_missing_from_all() -> None:
    for name in shmloader.__all__:  # the lazy names, once resolved, are in the namespace too
        getattr(shmloader, name)
    public = {
        name
        for name, value in vars(shmloader).items()
        if not name.startswith("_")
        # a submodule (``shmloader.errors``, ``shmloader.loader``) is an attribute once imported
        and not (
            isinstance(value, types.ModuleType)
            and value.__name__.startswith(f"{shmloader.__name__}.")
        )
    }
    public |= set(shmloader._LAZY)  # served by the module's __getattr__, resolved or not
    exported = set(shmloader.__all__)
    assert public - NOT_EXPORTED == exported, sorted((public - NOT_EXPORTED) ^ exported)


def test_the_version_is_the_projects() -> None:
    """One place: the distribution's version is read from ``shmloader.__version__``, which the
    daemon re-exports (the built wheel's metadata: tests/tools/test_packaging.py)."""
    import shmloaderd

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "shmloader.__version__"}
    assert shmloaderd.__version__ == shmloader.__version__


def test_the_exception_tree() -> None:
    found = _exceptions()
    assert {name: tuple(b.__name__ for b in cls.__bases__) for name, cls in found.items()} == (
        EXCEPTION_TREE
    )
    for name, cls in found.items():
        assert issubclass(cls, errors.ShmLoaderError), name
        assert getattr(shmloader, name) is cls, f"{name} is not exported by shmloader"
