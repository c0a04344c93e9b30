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

from shmloader._node import forks, unmap
from shmloader._node.ring import RingReader, RingWriter, new_token

OLD, NEW = 7, 9  # the batch's bytes, and what the slot holds once rewritten


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ring(nbytes: int, later: int = 0):
    """A slot holding ``OLD`` and a reader of it; ``later``: its views are leased, from the
    slot's standing mapping where they can be (NOTE [a standing mapping])."""
    token = new_token()
    writer = RingWriter(token, frozenset({1}), {"job": "forking"})
    reader = RingReader(token)
    reader.later = bool(later)
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


def racing(threads: int, per_thread: int, nbytes: int, later: int = 0) -> dict:
    """``threads`` threads fork ``per_thread`` children each at once, while another
    thread keeps mapping new views of the slot; every child reads the view that was
    the newest when it was forked."""
    forks.FORK_COPY_WAIT_S = 10.0  # a fork waiting on another fork's child shows, quickly
    warned = _Warnings()
    logging.getLogger("shmloader").addHandler(warned)
    writer, reader, slot = _ring(nbytes, later)
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
    assert unmap.settle(30)
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


def limited(nbytes: int, margin: int, later: int = 0) -> dict:
    """One child forked under an address-space limit ``margin`` bytes above the parent's
    use (``RLIMIT_AS``, as a job under a memory limit; 0: no limit). The parent drops
    its batch as soon as ``os.fork`` returns; where the child copied it the slot is
    rewritten at once, else (its hold) the slot must stay held until the child is gone."""
    warned = _Warnings()
    logging.getLogger("shmloader").addHandler(warned)
    writer, reader, slot = _ring(nbytes, later)
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
    unmap.settle(10)
    held_for_child = not released
    if released:  # the child has its own copy: the slot may be rewritten
        slot.payload[:nbytes] = NEW
    os.write(go_w, b"g")
    out = _wait_all([pid])
    # The next view this process maps lets go of what the gone child held.
    reader.view(name, 4096, lambda: None)
    gc.collect()
    unmap.settle(10)
    out.update(
        held_for_child=held_for_child,
        released_after=bool(released),
        warnings=warned.messages,
    )
    reader.close()
    writer.close()
    return out


def _slot_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split()[0] for line in f if "shml-" in line]


def _protection(addr: int) -> str:
    """The permissions of the mapping at ``addr`` (``""``: nothing mapped there)."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= addr < end:
                return line.split()[1]
    return ""


def _fork_and_report(addr: int, nbytes: int, expect: bytes) -> tuple[int, dict]:
    """Fork a child that reads ``nbytes`` at ``addr`` once told to, and says what it
    read and mapped: (its pid, the answer); the caller writes to ``go``."""
    go_r, go_w = os.pipe()
    answer_r, answer_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.read(go_r, 1)
        ok = not nbytes or ctypes.string_at(addr, nbytes) == expect
        report = {"read": ok, "slots": _slot_mappings(), "past": _protection(addr + nbytes)}
        os.write(answer_w, json.dumps(report).encode())
        os._exit(0)
    os.close(answer_w)
    return pid, {"go": go_w, "answer": answer_r}


def _answer(pipes: dict) -> dict:
    os.write(pipes["go"], b"g")
    answer = os.read(pipes["answer"], 1 << 16)  # b"": the child died before it answered
    return json.loads(answer) if answer else {"read": False, "slots": None, "past": None}


def standing(nbytes: int) -> dict:
    """A batch of half a slot lent from the slot's standing mapping, written into by the
    user, held at a fork: the child gets its bytes (the write too), no mapping of any
    slot, and the rest of the standing mapping's range only reserved (``---p``); the
    parent's next batch of that slot, from the same mapping, shows none of the write,
    and a fork after the batch was dropped gets no slot either."""
    writer, reader, slot = _ring(nbytes, later=1)
    name = slot.segment.name
    half = nbytes // 2
    released = []
    view = reader.view(name, half, lambda: released.append(1))
    addr = view.__array_interface__["data"][0]
    view[5] = 42  # the user's own write: a private page of the standing mapping
    expect = bytearray([OLD]) * half
    expect[5] = 42
    pid, pipes = _fork_and_report(addr, half, bytes(expect))
    del view
    gc.collect()
    unmap.settle(10)
    slot.payload[:nbytes] = NEW
    child = _answer(pipes)
    later_pid, later_pipes = _fork_and_report(addr, 0, b"")  # no batch held now
    later_child = _answer(later_pipes)
    out = _wait_all([pid, later_pid])
    again = reader.view(name, half, lambda: None)
    out.update(
        child_read=child["read"],
        child_slots=child["slots"],
        child_past=child["past"],
        later_child_slots=later_child["slots"],
        released=bool(released),
        same_mapping=again.__array_interface__["data"][0] == addr,
        next_batch=bool((again == NEW).all()),
    )
    del again
    unmap.settle(10)
    reader.close()
    writer.close()
    return out


def main() -> None:
    scenario, *args = sys.argv[1:]
    fn = {"racing": racing, "limited": limited, "standing": standing}[scenario]
    print(json.dumps(fn(*(int(a) for a in args))), flush=True)


if __name__ == "__main__":
    main()
