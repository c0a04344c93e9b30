"""The daemon's warm segments (``WarmSegments``, ``--pool``): pre-touched shared-memory
segments a ring adopts instead of creating and faulting in its own. It owns those
segments (named ``/shml-<token>-<n>.<random>``, owned by the daemon until one is
adopted), their filler thread and the ``adopt`` that renames one to a job's name with
the job as its owner; the registry's budget is told their bytes and may shrink them,
and nothing else of the daemon is touched. The ``adopt`` exchange, the ownership rule
it keeps and the segments' states: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmloader._node import segment as segment_module
from shmloader._node.mapping import touch
from shmloader._node.segment import (
    HEADER_SIZE,
    KIND_DATA,
    PREFIX,
    Header,
    Segment,
    process_alive,
    shm_free_bytes,
    shm_path,
)
from shmloader.errors import ProtocolError, ShmCapacityError, human_bytes

log = logging.getLogger("shmloaderd")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _libc_madvise() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _libc_madvise()


def populate(mm: mmap.mmap) -> None:
    """Fault every page of ``mm`` in without holding the GIL (NOTE [pool off the loop]).

    libc's ``madvise(MADV_POPULATE_WRITE)`` through ``ctypes`` (a foreign call
    releases the GIL); where the kernel lacks it, ``mapping.touch`` writes
    page by page, in bytecode that yields the GIL between pages.
    """
    if _MADVISE is not None:
        view = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(view)
        del view  # the buffer export must not outlive this line, or mm cannot close
        if _MADVISE(addr, len(mm), _MADV_POPULATE_WRITE) == 0:
            return
    touch(mm)


@dataclass
class WarmSegment:
    segment: Segment

    @property
    def nbytes(self) -> int:
        return HEADER_SIZE + self.segment.capacity


class WarmSegments:
    """Up to ``target`` bytes of warm segments of ``segment_bytes`` payload each.

    NOTE [pool off the loop]
        Creating and touching a warm segment takes as long as faulting in its
        pages (hundreds of ms per GiB, seconds on a busy node), so it never runs
        on the daemon's loop: a loop blocked past a client's timeout made every
        client give up on the daemon. One filler thread does it; the loop only
        asks (``request_refill``). The segment being filled counts in ``nbytes``
        (it holds memory) but cannot be adopted or shrunk until it is ready.
        ``items`` is guarded by ``lock``; the loop's ``adopt`` and ``shrink`` take
        ready items only. The filler must also let go of the GIL while the pages
        fault in: ``mmap.madvise`` holds it for the whole call, and a 2.9 GiB
        ``MADV_POPULATE_WRITE`` froze the loop thread for 4 s although it ran on
        another thread. ``populate`` calls libc's ``madvise`` through ``ctypes``,
        which releases the GIL for the call.
    """

    def __init__(self, target: int, segment_bytes: int) -> None:
        self.target = target
        self.segment_bytes = segment_bytes
        self.token = "pool" + secrets.token_hex(6)  # "shml-pool...": the names stay as they were
        self.items: list[WarmSegment] = []
        self.lock = threading.Lock()  # NOTE [pool off the loop]
        self.filling = 0  # bytes of the segment the filler is making now
        self._next = 0
        self.adopted = 0
        self._wanted: int | bool | None = False  # room of the latest request; False: none
        self._wake = threading.Condition(self.lock)
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(p.nbytes for p in self.items) + self.filling

    # -- the filler thread (NOTE [pool off the loop]) --------------------

    def start(self) -> None:
        """Start the filler thread (nothing to do without ``--pool``)."""
        if self.target > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="warm-filler", daemon=True)
            self._thread.start()

    def request_refill(self, room: int | None) -> None:
        """From the loop: make one more segment if ``room`` (budget left) allows. Never blocks
        on the filler's work; without a started filler (tests) it refills inline."""
        if self._thread is None:
            self.refill(room)
            return
        with self._wake:
            self._wanted = room
            self._wake.notify()

    def _fill(self) -> None:
        while True:
            with self._wake:
                while self._wanted is False and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                room, self._wanted = self._wanted, False
            try:
                self.refill(room)
            except Exception:
                log.exception("warm segments: refill failed; trying again at the next pass")

    def refill(self, room: int | None) -> bool:
        """Create one segment if there are fewer than ``target`` bytes and ``room`` (budget
        left) allows.

        NOTE [warm segment names]
            The warm segments' token is visible to every local user as soon as the
            first one is in ``/dev/shm``, and so would be every later name if it
            were ``<token>-<n>``: a FIFO or a file planted at the next one made
            every refill fail (none was ever made again). Each warm segment
            therefore ends in its own random part (``Segment.create_unique``, NOTE
            [unpredictable names] in ``shmloader._node.segment``): a name already taken
            means another draw. Every open is ``O_NOFOLLOW | O_NONBLOCK`` and checked
            regular, ours and 0600 before use (``Segment``). ``adopt`` links the
            segment to the name the client drew (also random); ``link`` never follows
            or replaces what is there.
        """
        need = HEADER_SIZE + self.segment_bytes
        if self.target <= 0 or self.nbytes + need > self.target:
            return False
        if room is not None and room < need:
            return False
        free = shm_free_bytes()
        if free is not None and free < 2 * need:  # never take the last of /dev/shm
            return False
        stem = f"/{PREFIX}{self.token}-{self._next}"
        self._next += 1
        with self.lock:
            self.filling = need
        try:
            try:  # NOTE [warm segment names]
                segment = Segment.create_unique(stem, KIND_DATA, self.token, self.segment_bytes)
            except (ShmCapacityError, ProtocolError, OSError) as exc:
                log.warning("warm segments: could not create %s.*: %s", stem, exc)
                return False
            name = segment.name
            try:
                mm = segment.map_shared()
                try:
                    populate(mm)
                finally:
                    mm.close()
            except BaseException:
                segment.unlink()
                segment.close()
                raise
            with self.lock:
                if self._stop:  # closed while we touched it
                    segment.unlink()
                    segment.close()
                    return False
                self.items.append(WarmSegment(segment))
        finally:
            with self.lock:
                self.filling = 0
        log.debug("warm segments: %s ready (%s)", name, human_bytes(need))
        return True

    def shrink(self, need: int) -> int:
        """Unlink ready warm segments until ``need`` bytes are freed; bytes freed."""
        freed = 0
        with self.lock:
            taken = []
            while self.items and freed < need:
                item = self.items.pop()
                freed += item.nbytes
                taken.append(item)
        for item in taken:
            item.segment.unlink()
            item.segment.close()
        if freed:
            log.info("warm segments: gave back %s to make room", human_bytes(freed))
        return freed

    def adopt(
        self,
        token: str,
        name: str,
        nbytes: int,
        pid: int,
        start: int,
        pidns: int = 0,
        *,
        uid: int | None = None,
        gid: int | None = None,
    ) -> dict:
        """Hand the smallest fitting warm segment to ``(pid, start)`` as ``name``.

        ``pidns`` is the adopter's pid namespace (0: unknown). A pid of our own
        namespace must run; one of another namespace cannot be checked here
        (NOTE [pid namespaces] in ``registry``). The new header names the
        adopter's namespace, so no reaper judges it by a pid of another one.

        ``uid``/``gid`` (node mode, NOTE [tenants] in ``tenants``): the adopting
        user. The segment is ``fchown``-ed to it and set to mode 0600 and its
        header names that uid before its new name is linked: the job never maps
        a segment another user could open (the warm one was the daemon's,
        0600, and only the daemon held it open).
        """
        mine = segment_module.MY_PIDNS
        foreign = bool(pidns and mine and pidns != mine)
        if not foreign and not process_alive(pid, start):
            return {"ok": False, "error": f"adopt: pid {pid} (start {start}) is not running"}
        with self.lock:
            fits = [p for p in self.items if p.segment.capacity >= nbytes]
            if fits:
                item = min(fits, key=lambda p: p.segment.capacity)
                self.items.remove(item)
            held = len(self.items)
        if not fits:
            return {
                "ok": True,
                "adopted": False,
                "reason": f"no warm segment of >= {nbytes} bytes (the daemon holds "
                f"{held} of {self.segment_bytes} bytes; raise --pool-segment)",
            }
        seg = item.segment
        old = seg.header
        # a pid that runs here is of our namespace (NOTE [segment trust] in ``segment``)
        owner_ns = pidns or mine
        owner = old.uid if uid is None else uid
        new = Header(KIND_DATA, owner, token, pid, start, old.capacity, time.time_ns(), owner_ns)
        try:
            if owner != old.uid:  # hand it over before it gets a name the user can open
                os.fchown(seg.fd, owner, os.getegid() if gid is None else gid)
            os.fchmod(seg.fd, 0o600)
            new.write(seg.fd)
            os.link(shm_path(seg.name), shm_path(name))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.fchown(seg.fd, old.uid, os.getegid())
            old.write(seg.fd)  # still ours
            with self.lock:
                self.items.append(item)
            why = "it exists" if exc.errno == errno.EEXIST else exc.strerror
            return {"ok": False, "error": f"adopt: cannot name the segment {name}: {why}"}
        seg.unlink()
        seg.close()
        self.adopted += 1
        log.info("warm segments: %s adopted as %s by pid %d (uid %d)", seg.name, name, pid, owner)
        return {"ok": True, "adopted": True, "name": name, "capacity": old.capacity}

    def close(self, wait: float = 5.0) -> None:
        """Stop the filler (a segment it is touching is unlinked when done) and unlink all."""
        with self._wake:
            self._stop = True
            self._wake.notify()
            items, self.items = self.items, []
        if self._thread is not None:
            self._thread.join(wait)
        for item in items:
            with contextlib.suppress(OSError):
                item.segment.unlink()
                item.segment.close()
