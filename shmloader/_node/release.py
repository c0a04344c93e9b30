"""Release words: who still holds a pool slot, readable without the leader's main process.

It owns the release area of the pool's control segment (the holder table, each
slot's HOLDERS mask, GONE bits and each holder's last released ticket: NOTE
[release words]): the writer's side (``ReleaseWords``, which a claiming
DataLoader worker reads) and a reader's (``ReaderWords``, its own column only).
It touches nothing but those words of a segment it is given, and imports only
``segment`` and ``errors``.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable

import numpy as np

from ..errors import ProtocolError
from .segment import HEADER_SIZE, KIND_DATA, MY_PIDNS, Segment, process_alive

# NOTE [release words]
#     Layout, in 8-byte words of the pool control segment's payload (the
#     pool's words 4 and 5 say where the area starts and how many holders
#     ``R`` it has; ``T`` is the pool's slot count)::
#
#         area + 0             GONE: bit j set once holder j's holds ended
#                              (the writer dropped it: BYE, or lost)
#         area + 1 .. 7        reserved
#         area + 8 + 4j        holder j: rank, pid, start time, pid namespace
#                              (j = 0: the writer itself; 1 .. R-1: its readers)
#         area + 8 + 4R        slot 0: HOLDERS (bit j: j holds the current batch),
#           + (R + 1) i              then R words: the ticket holder j released last
#                                    (0: none)
#
#     Who writes what (every store one aligned 8-byte word):
#
#     - the writer's main process: the holder table once, at creation; a
#       slot's HOLDERS when it adopts the slot's batch, *before* the pool
#       state says HELD (so a claimer never pairs HELD with an older mask);
#       GONE when a reader said BYE or was found lost; its own word when its
#       view of the batch dies.
#     - each reader: its own word of a slot, with the ticket the BATCH
#       announcement carried, when its view of that batch dies;
#     - nobody else. A worker only reads.
#
#     The rule a claimer applies (under its partition's lock, ``pool``): a
#     HELD slot with ticket ``t`` is free when every holder j in its
#     HOLDERS mask has word ``t``, or its GONE bit, or is a process the
#     claimer saw dead (pid and start time, same pid namespace only).
#
#     Why reuse is then safe: a reader maps its batch MAP_PRIVATE, and such a
#     mapping shows the file's *later* writes on every page it has not
#     copied. So a word is written only once the mapping is gone: from a
#     finalizer of the mmap object, which CPython runs after ``munmap``
#     (``views.private_view``; never at interpreter exit, when the mapping is
#     still there). A reader that closes first makes every page it still
#     holds its own (NOTE [held past close] in ``ring``) and only then says
#     BYE, which is what sets GONE; a dead reader has no mappings left. A
#     batch a rank still references therefore never changes, and the device
#     stage's copy (NOTE [device reads]) completes before the view it holds
#     dies.
#
#     Forgery: tickets only grow (each claim of a slot takes the next one), a
#     word counts only for a holder in the slot's HOLDERS mask and only when
#     it equals the slot's current ticket. A word for another ticket, or in a
#     column nobody holds, changes nothing; a process of the job's uid that
#     writes the right ticket into a holder's column could as well write the
#     slot's payload (mode 0600: nothing outside the uid can write either).
#: The most holders (writer + readers of one node) a HOLDERS mask can name.
MAX_HOLDERS = 64
#: Words of the pool control segment that locate the area (0 when there is none).
AREA_AT, HOLDER_COUNT = 4, 5
#: The rank of a holder column no rank owns (a writer that holds no view of its own).
NOBODY = (1 << 64) - 1
_GONE = 0
_TABLE = 8  # words before the holder table
_ENTRY = 4  # rank, pid, start, pid namespace
RANK, PID, START, PIDNS = range(_ENTRY)


def area_words(total: int, holders: int) -> int:
    """Words the area takes for ``total`` slots and ``holders`` holders."""
    return _TABLE + _ENTRY * holders + total * (holders + 1)


class ReleaseWords:
    """The area inside a pool control segment's word array (any process's view)."""

    def __init__(self, words: np.ndarray, at: int, holders: int, total: int) -> None:
        if not 0 < holders <= MAX_HOLDERS or at <= 0:
            raise ProtocolError(f"release area of {holders} holders at word {at} is malformed")
        if at + area_words(total, holders) > len(words):
            raise ProtocolError("release area runs past the pool control segment")
        self.words = words
        self.at = at
        self.holders = holders
        self.total = total
        self._slots = at + _TABLE + _ENTRY * holders
        self._index: dict[int, int] | None = None  # rank -> j, read once from the table

    @classmethod
    def of(cls, words: np.ndarray, total: int) -> ReleaseWords | None:
        """The area a pool control's words locate, or None when the pool has none."""
        at, holders = int(words[AREA_AT]), int(words[HOLDER_COUNT])
        return None if at == 0 else cls(words, at, holders, total)

    # -- the writer ------------------------------------------------------

    def init(self, table: Iterable[tuple[int, int, int, int]]) -> None:
        """Write the holder table (rank, pid, start, pid namespace), j = 0 the writer."""
        for j, entry in enumerate(table):
            base = self.at + _TABLE + _ENTRY * j
            self.words[base : base + _ENTRY] = entry
        self._index = None

    def holder(self, j: int) -> tuple[int, int, int, int]:
        base = self.at + _TABLE + _ENTRY * j
        rank, pid, start, pidns = (int(w) for w in self.words[base : base + _ENTRY])
        return rank, pid, start, pidns

    def index_of(self, rank: int) -> int | None:
        """Holder ``j`` of ``rank``, or None when it is not one."""
        if self._index is None:
            self._index = {}
            for j in range(self.holders):
                self._index.setdefault(self.holder(j)[RANK], j)
        return self._index.get(rank)

    def hold(self, i: int, ranks: Iterable[int]) -> None:
        """Slot ``i``'s new batch is held by ``ranks`` (before its state says PUBLISHED)."""
        mask = 0
        for rank in ranks:
            j = self.index_of(rank)
            if j is not None:
                mask |= 1 << j
        self.words[self._slots + (self.holders + 1) * i] = mask

    def drop(self, rank: int) -> None:
        """``rank``'s holds ended (BYE after owning its views, or lost): GONE."""
        j = self.index_of(rank)
        if j is not None:
            self.words[self.at + _GONE] = int(self.words[self.at + _GONE]) | (1 << j)

    # -- every holder ----------------------------------------------------

    def release(self, i: int, j: int, ticket: int) -> None:
        """Holder ``j`` is done with slot ``i``'s batch of ``ticket`` (its mapping is gone)."""
        if 0 <= i < self.total and 0 <= j < self.holders and ticket > 0:
            self.words[self._slots + (self.holders + 1) * i + 1 + j] = ticket

    # -- a claimer -------------------------------------------------------

    def blocking(self, i: int, ticket: int, dead: int = 0) -> int:
        """Mask of slot ``i``'s holders that have not released ``ticket``."""
        base = self._slots + (self.holders + 1) * i
        waiting = int(self.words[base]) & ~int(self.words[self.at + _GONE]) & ~dead
        j = 0
        left = waiting
        while left:
            if left & 1 and int(self.words[base + 1 + j]) == ticket:
                waiting &= ~(1 << j)
            left >>= 1
            j += 1
        return waiting

    def released(self, i: int, ticket: int, dead: int = 0) -> bool:
        """Every holder of slot ``i``'s batch of ``ticket`` released it (NOTE [release words])."""
        return self.blocking(i, ticket, dead) == 0

    def dead_among(self, mask: int) -> int:
        """The holders in ``mask`` whose process is gone (judged in our pid namespace only)."""
        dead = 0
        for j in range(1, self.holders):  # j = 0 is the writer: the owner check covers it
            if not mask >> j & 1:
                continue
            _rank, pid, start, pidns = self.holder(j)
            same_ns = not pidns or not MY_PIDNS or pidns == MY_PIDNS
            if same_ns and pid and not process_alive(pid, start):
                dead |= 1 << j
        return dead


def announced_words(body: dict) -> tuple[str, int, int] | None:
    """(pool control, slot, ticket) of a BATCH body that names a release word, else None.

    Malformed fields count as absent: the reader then releases by message only.
    """
    name, slot, ticket = body.get("rel"), body.get("slot"), body.get("tk")
    if type(name) is not str or type(slot) is not int or type(ticket) is not int:
        return None
    return (name, slot, ticket) if slot >= 0 and ticket > 0 else None


class ReaderWords:
    """A reader's handle on its column of a pool's release words (``ring.RingReader``)."""

    def __init__(self, name: str, token: str, rank: int) -> None:
        self.name = name
        self.segment = Segment.attach(name, kind=KIND_DATA, token=token)
        try:
            self._mm: mmap.mmap | None = self.segment.map_shared()
            words = np.frombuffer(self._mm, np.uint64, offset=HEADER_SIZE)
            # the slot count: the pool's words 1 and 2 (workers x slots per worker)
            total = int(words[1]) * int(words[2])
            area = ReleaseWords.of(words, total)
            j = None if area is None else area.index_of(rank)
            if area is None or j is None:
                raise ProtocolError(f"pool {name} keeps no release word for rank {rank}")
        except BaseException:
            self.close()
            raise
        self.area: ReleaseWords | None = area
        self.j = j

    def release(self, slot: int, ticket: int) -> None:
        """This reader's view of slot ``slot``'s batch ``ticket`` is gone."""
        if self.area is not None:
            self.area.release(slot, self.j, ticket)

    def close(self) -> None:
        self.area = None
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        self.segment.close()


__all__ = ["MAX_HOLDERS", "NOBODY", "ReaderWords", "ReleaseWords", "announced_words", "area_words"]
