"""``Iteration``: what ``iter(ShmLoader)`` returns, the user's end of one pass.

It owns three rules of the iterator a user holds, whatever role runs below
it: it keeps its loader alive (NOTE [an iterator keeps its loader]), an error
it raised is raised again at every later ``next()``, and an iterator that a
later ``iter()`` or ``set_epoch`` ended says so by name. It imports only
``errors``; ``ShmLoader.__iter__`` makes one around its pipeline.

NOTE [an iterator keeps its loader]
    ``for batch in ShmLoader(make, group=g):`` keeps no name for the loader,
    as people write ``for batch in DataLoader(...)``. The loader's finalizer
    closes it once nothing refers to it, so the iterator refers to it:
    the loader lives until the loop is over and the iterator dropped, then
    closes on every rank alike. Nothing the roles hold refers back to the
    loader (a dropped loader is still freed at once, not at the next cycle
    collection), and the iterator drops its pipeline before its loader, so
    a halted loop stops before the loader closes.

    A sharing ``ShmLoader`` runs one pass at a time: its ranks count passes
    to agree on which batches belong together (NOTE [iteration numbers] in
    ``cursor``). A second ``iter()``, or a ``set_epoch`` while a pass is
    under way, therefore ends the pass in use; that iterator's next
    ``next()`` raises ``ShmLoaderError`` naming the call that ended it. With
    sharing off (the ``local`` role) nothing is ended: as with a plain
    DataLoader, both iterators go on.

    An error a pass raised ends it (the leader's loader raised, a peer was
    lost): every later ``next()`` of that iterator raises the same error
    again, on every rank, so a loop that catches it and calls ``next()``
    again never trains on a silently short epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import ShmLoaderError


class Iteration:
    """One pass over a ``ShmLoader``'s epoch, as the user's thread sees it."""

    __slots__ = ("__weakref__", "_ended_by", "_error", "_inner", "_loader")

    def __init__(self, inner: Iterator[Any], loader: object) -> None:
        # NOTE [an iterator keeps its loader]: the pipeline is dropped before the
        # loader, whose finalizer may then close it
        self._inner: Iterator[Any] | None = inner
        self._error: Exception | None = None
        self._ended_by: str | None = None
        self._loader: object | None = loader

    def __iter__(self) -> Iteration:
        return self

    def __next__(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._ended_by is not None:
            raise ShmLoaderError(
                f"this iterator of the ShmLoader was ended by {self._ended_by}: a sharing "
                "ShmLoader runs one pass at a time on every rank of its group; finish or "
                "leave a pass before calling iter() or set_epoch() again"
            )
        if self._inner is None:
            raise StopIteration
        try:
            return next(self._inner)  # NOTE [no batch in the frame] (base): no local keeps it
        except StopIteration:
            self._drop()
            raise
        except Exception as exc:
            self._error = exc
            self._drop()
            raise

    def live(self) -> bool:
        """Whether this pass may still deliver (not finished, failed, ended or closed)."""
        return self._inner is not None

    def end_by(self, call: str) -> None:
        """A later ``call`` on the loader ended this pass (NOTE [an iterator keeps its loader])."""
        if self.live():
            self._ended_by = call
            self._drop()

    def close(self) -> None:
        """Leave the pass, as dropping the iterator does: its loop stops."""
        self._drop()

    def _drop(self) -> None:
        inner, self._inner = self._inner, None
        close = getattr(inner, "close", None)
        if close is not None:
            close()
        del inner
        self._loader = None
