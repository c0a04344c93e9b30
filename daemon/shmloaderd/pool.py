"""The warm pool: pre-touched shared-memory segments a ring can adopt.

The first write into fresh tmpfs pages costs about ten times a rewrite
(DESIGN: 160-200 ms against 23-26 ms for 256 MiB). With ``--pool BYTES`` the
daemon keeps up to that many bytes of segments whose pages are already
faulted in, named ``/shml-<pool token>-<n>`` and owned (header pid, start) by
the daemon. A ring writer that needs a slot asks to ``adopt`` one::

    client                                   shmloaderd
    adopt {token, name, bytes, pid, start} -->  pick the smallest pooled segment
                                                with capacity >= bytes;
                                                rewrite its header: kind data,
                                                token, owner (pid, start), now;
                                                link() it to ``name`` (fails if
                                                the name exists), unlink the
                                                pool name
                                           <--  {adopted: true, name, capacity}
    Segment.attach(name, kind=KIND_DATA, token=token) and use it as its own

or ``{adopted: false, reason}`` when nothing fits (the client then creates
the segment itself, after ``admit``). ``/dev/shm`` files are renamed with
``link`` + ``unlink`` rather than ``rename`` so an existing name is never
replaced. A header rewritten to the new owner before the link means the
segment is, at every instant, owned either by the live daemon or by the
adopter: the reaper's rule (NOTE [reaping rule] in ``shmloader.admin``) keeps
it while that owner lives and frees it after.

Pool state per segment (zero is invalid)::

    INVALID --create+touch--> POOLED --adopt--> (the job's) ; POOLED --trim/stop--> unlinked

The pool counts against the node budget; ``admit`` shrinks it to make room
(NOTE [budget] in ``registry``). It refills one segment per reaper pass, only
while the budget and /dev/shm leave room for it. SIGTERM unlinks the pool;
after a SIGKILL its segments have a dead owner and are reaped like any other.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import time
from dataclasses import dataclass

from shmloader.errors import ProtocolError, ShmCapacityError, human_bytes
from shmloader.segment import (
    HEADER_SIZE,
    KIND_DATA,
    PREFIX,
    Header,
    Segment,
    process_alive,
    shm_free_bytes,
    shm_path,
    touch,
)

log = logging.getLogger("shmloaderd")


@dataclass
class Pooled:
    segment: Segment

    @property
    def nbytes(self) -> int:
        return HEADER_SIZE + self.segment.capacity


class Pool:
    """Up to ``target`` bytes of pooled segments of ``segment_bytes`` payload each."""

    def __init__(self, target: int, segment_bytes: int) -> None:
        self.target = target
        self.segment_bytes = segment_bytes
        self.token = "pool" + secrets.token_hex(6)
        self.items: list[Pooled] = []
        self._next = 0
        self.adopted = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.items)

    def refill(self, room: int | None) -> bool:
        """Create one segment if the pool is short and ``room`` (budget left) allows."""
        need = HEADER_SIZE + self.segment_bytes
        if self.target <= 0 or self.nbytes + need > self.target:
            return False
        if room is not None and room < need:
            return False
        free = shm_free_bytes()
        if free is not None and free < 2 * need:  # never take the last of /dev/shm
            return False
        name = f"/{PREFIX}{self.token}-{self._next}"
        self._next += 1
        try:
            segment = Segment.create(name, KIND_DATA, self.token, self.segment_bytes)
        except (ShmCapacityError, ProtocolError, OSError) as exc:
            log.warning("warm pool: could not create %s: %s", name, exc)
            return False
        try:
            mm = segment.map_shared()
            try:
                touch(mm)
            finally:
                mm.close()
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        self.items.append(Pooled(segment))
        log.debug("warm pool: %s ready (%s)", name, human_bytes(need))
        return True

    def shrink(self, need: int) -> int:
        """Unlink pooled segments until ``need`` bytes are freed; bytes freed."""
        freed = 0
        while self.items and freed < need:
            item = self.items.pop()
            freed += item.nbytes
            item.segment.unlink()
            item.segment.close()
        if freed:
            log.info("warm pool: gave back %s to make room", human_bytes(freed))
        return freed

    def adopt(self, token: str, name: str, nbytes: int, pid: int, start: int) -> dict:
        """Hand the smallest fitting pooled segment to ``(pid, start)`` as ``name``."""
        if not process_alive(pid, start):
            return {"ok": False, "error": f"adopt: pid {pid} (start {start}) is not running"}
        fits = [p for p in self.items if p.segment.capacity >= nbytes]
        if not fits:
            return {
                "ok": True,
                "adopted": False,
                "reason": f"no pooled segment of >= {nbytes} bytes (pool holds "
                f"{len(self.items)} of {self.segment_bytes} bytes; raise --pool-segment)",
            }
        item = min(fits, key=lambda p: p.segment.capacity)
        seg = item.segment
        old = seg.header
        new = Header(KIND_DATA, old.uid, token, pid, start, old.capacity, time.time_ns())
        os.pwrite(seg.fd, new.pack(), 0)
        try:
            os.link(shm_path(seg.name), shm_path(name))
        except OSError as exc:
            os.pwrite(seg.fd, old.pack(), 0)  # still ours
            why = "it exists" if exc.errno == errno.EEXIST else exc.strerror
            return {"ok": False, "error": f"adopt: cannot name the segment {name}: {why}"}
        self.items.remove(item)
        seg.unlink()
        seg.close()
        self.adopted += 1
        log.info("warm pool: %s adopted as %s by pid %d", seg.name, name, pid)
        return {"ok": True, "adopted": True, "name": name, "capacity": old.capacity}

    def close(self) -> None:
        for item in self.items:
            with contextlib.suppress(OSError):
                item.segment.unlink()
                item.segment.close()
        self.items.clear()
