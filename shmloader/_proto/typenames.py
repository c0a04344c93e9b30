"""Type names in batch metadata: ``module:qualname``, and their lookup on a rank.

It owns how the codec names the namedtuple, dataclass and mapping types of a batch
(``name_of``), the leader's check that another rank gets the very same type back by
that name (``resolves_back``), and the lookup of a name a peer sent (``resolve``):
only in modules already imported, or allowed (``allow_modules``; NOTE [no imports
from metadata]), and only a type that really is what the metadata says. Pure: it
imports no module a peer names, and imports only ``errors``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import sys
from typing import Any

from ..errors import ProtocolError


def name_of(t: type) -> str:
    """``t``'s name in metadata: ``module:qualname``."""
    return f"{t.__module__}:{t.__qualname__}"


def resolves_back(name: str, what: str, t: type) -> bool:
    """Whether ``name`` (of ``t``, a ``what``) looks up as ``t`` itself on a rank.

    A type defined inside a function, say, does not: a follower would drop every
    batch naming it as malformed, so the encoder refuses it first.
    """
    if _RESOLVED.get((what, name)) is t:
        return True
    _RESOLVED.pop((what, name), None)  # not seen yet, or stale (a reloaded module)
    try:
        return resolve(name, what) is t
    except ProtocolError:
        return False


#: Modules a peer's metadata may make this rank import (``allow_modules``).
_ALLOWED_MODULES: set[str] = set()


def allow_modules(*names: str) -> None:
    """Let batch metadata name types of these modules even before they are imported.

    NOTE [no imports from metadata]
        Metadata names the namedtuple/dataclass types of a batch as
        ``module:qualname``. A rank only ever looks such a type up in a module
        it has already imported (``sys.modules``): importing a module runs its
        code, and a name chosen by a peer (or a corrupted message) must not
        decide which code runs here. A module that a rank does not import on
        its own (the leader's data code imports it lazily) is either imported
        by the training script on every rank or listed here.
    """
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"module names are non-empty strings, got {name!r}")
        _ALLOWED_MODULES.add(name)


#: Keyed by (what, name): a name checked as a dataclass must not pass later as
#: a namedtuple (its __init__, and __post_init__, would run on follower input).
_RESOLVED: dict[tuple[str, str], type] = {}


def resolve(name: Any, what: str) -> type:
    """Look up a namedtuple/dataclass/mapping type named by the leader.

    Only in modules already imported here, or allowed (NOTE [no imports from
    metadata]). Only types that really are what ``what`` says are accepted
    (a mapping: a ``Mapping`` class other than ``dict``); nothing is called but
    the type's own constructor (namedtuple, mapping) or ``object.__new__``.
    """
    cls = _RESOLVED.get((what, name)) if isinstance(name, str) else None
    if cls is not None:
        return cls
    if not isinstance(name, str) or name.count(":") != 1:
        raise ProtocolError(f"bad type name {name!r:.80}")
    module_name, qualname = name.split(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None and module_name not in _ALLOWED_MODULES:
        raise ProtocolError(
            f"the {what} type {name} lives in module {module_name!r}, which this rank has not "
            "imported; shmloader never imports a module a peer names. Import it on every rank "
            f"before iterating, or call shmloader._proto.typenames.allow_modules({module_name!r})"
        )
    try:
        if obj is None:
            obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any failure to import (a module may raise anything) is bad input
        raise ProtocolError(
            f"cannot import the {what} type {name} on this rank ({exc}); define it in an "
            "importable module (not inside a function) so every rank can rebuild it"
        ) from None
    if not isinstance(obj, type):
        ok = False
    elif what == "namedtuple":
        ok = issubclass(obj, tuple) and hasattr(obj, "_fields")
    elif what == "mapping":  # NOTE [mappings] in ``codec``: never dict itself ("D" carries it)
        ok = issubclass(obj, collections.abc.Mapping) and obj is not dict
    else:
        ok = dataclasses.is_dataclass(obj)
    if not ok:
        raise ProtocolError(f"{name} is not a {what}")
    _RESOLVED[(what, name)] = obj
    return obj
