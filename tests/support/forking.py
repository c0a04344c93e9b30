"""Fork scenarios run in a fresh interpreter (``python -m tests.support.forking <scenario>``).

Each forks from several threads of one process, which a test must never do in the
pytest process itself (tests/multirank/test_forks.py says why), and prints one JSON
line of what its children read. A child reads a batch view it inherited only after
the parent dropped the batch and rewrote its slot with other bytes: a child that
still maps the slot reads those.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import resource
import sys
import threading
import time

from shmloader._node import forks
from shmloader._node.ring import RingReader, RingWriter, new_token

OLD, NEW = 7, 9  # the batch's bytes, and what the slot holds once rewritten


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ring(nbytes: int):
    token = new_token()
    writer = RingWriter(token, frozenset({1}), {"job": "forking"})
    reader = RingReader(token)
    slot = writer.acquire(nbytes)
    slot.payload[:nbytes] = OLD
    reader.open(slot.segment.name)
    return writer, reader, slot


def _wait_all(pids: list[int]) -> dict[str, int]:
    out = {"read_batch": 0, "read_other": 0, "signalled": 0, "other": 0}
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            out["signalled"] += 1
        elif os.WEXITSTATUS(status) == 0:
            out["read_batch"] += 1
        elif os.WEXITSTATUS(status) == 3:
            out["read_other"] += 1
        else:
            out["other"] += 1
    return out


_PIECE = 1 << 16
_OLD_PIECE = bytes([OLD]) * _PIECE  # made before any fork: a limited child allocates little


def _child_reads(go: int, where: list, nbytes: int) -> None:  # pragma: no cover - child
    os.read(go, 1)  # the parent has dropped the batch and rewritten its slot by now
    addr = where[0]
    ok = all(
        ctypes.string_at(addr + at, min(_PIECE, nbytes - at)) == _OLD_PIECE[: nbytes - at]
        for at in range(0, nbytes, _PIECE)
    )
    os._exit(0 if ok else 3)


def racing(threads: int, per_thread: int, nbytes: int) -> dict:
    """``threads`` threads fork ``per_thread`` children each at once, while another
    thread keeps mapping new views of the slot; every child reads the view that was
    the newest when it was forked."""
    forks.FORK_COPY_WAIT_S = 10.0  # a fork waiting on another fork's child shows, quickly
    warned = _Warnings()
    logging.getLogger("shmloader").addHandler(warned)
    writer, reader, slot = _ring(nbytes)
    name = slot.segment.name
    newest = [0, None]  # (address, view): what a child forked now reads
    first = reader.view(name, nbytes, lambda: None)
    newest[:] = [first.__array_interface__["data"][0], first]
    del first
    go_r, go_w = os.pipe()
    pids: list[int] = []
    longest = [0.0]
    lock = threading.Lock()
    stop = threading.Event()

    def mapper() -> None:
        while not stop.is_set():
            view = reader.view(name, nbytes, lambda: None)
            newest[:] = [view.__array_interface__["data"][0], view]  # one store: atomic
            del view

    def forker() -> None:
        for _ in range(per_thread):
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                _child_reads(go_r, newest, nbytes)
            took = time.monotonic() - t0
            with lock:
                pids.append(pid)
                longest[0] = max(longest[0], took)

    mapping = threading.Thread(target=mapper)
    mapping.start()
    workers = [threading.Thread(target=forker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    mapping.join()
    newest[:] = [0, None]
    gc.collect()
    slot.payload[:nbytes] = NEW  # the parent holds no view: the slot may be rewritten
    os.write(go_w, b"g" * len(pids))
    out = _wait_all(pids)
    out.update(longest_fork_s=longest[0], warnings=warned.messages, children=len(pids))
    reader.close()
    writer.close()
    return out


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def limited(nbytes: int, margin: int) -> dict:
    """One child forked under an address-space limit ``margin`` bytes above the parent's
    use (``RLIMIT_AS``, as a job under a memory limit; 0: no limit). The parent drops
    its batch as soon as ``os.fork`` returns; where the child copied it the slot is
    rewritten at once, else (its hold) the slot must stay held until the child is gone."""
    warned = _Warnings()
    logging.getLogger("shmloader").addHandler(warned)
    writer, reader, slot = _ring(nbytes)
    name = slot.segment.name
    released = []
    view = reader.view(name, nbytes, lambda: released.append(1))
    where = [view.__array_interface__["data"][0]]
    go_r, go_w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if margin:
        resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + margin, hard))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            _child_reads(go_r, where, nbytes)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    del view
    gc.collect()
    held_for_child = not released
    if released:  # the child has its own copy: the slot may be rewritten
        slot.payload[:nbytes] = NEW
    os.write(go_w, b"g")
    out = _wait_all([pid])
    # The next view this process maps lets go of what the gone child held.
    reader.view(name, 4096, lambda: None)
    gc.collect()
    out.update(
        held_for_child=held_for_child,
        released_after=bool(released),
        warnings=warned.messages,
    )
    reader.close()
    writer.close()
    return out


def main() -> None:
    scenario, *args = sys.argv[1:]
    fn = {"racing": racing, "limited": limited}[scenario]
    print(json.dumps(fn(*(int(a) for a in args))), flush=True)


if __name__ == "__main__":
    main()
