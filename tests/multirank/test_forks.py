"""No test forks from a multi-threaded process (Python 3.12 warns: the child may deadlock).

DataLoader workers and ``multiprocessing`` children without an explicit
context start by the default method, fork on Linux before Python 3.14. The
pytest process runs ZeroMQ threads once an in-process test made a socket, and
a rank runs gloo and ZeroMQ threads before its loader starts workers. The
harness makes forkserver the default in both (``harness.fork_safe_workers``,
from ``conftest.pytest_configure`` and from every rank), with torch preloaded
in the server so a worker starts about as fast as a fork.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import zmq

from shmloader import Config, ShmLoader
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _load_recording_forks(make) -> dict:
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(_threads()))
    threads = _threads()
    seen = sum(1 for _ in make())
    return {"forks": forks, "seen": seen, "threads": threads, "method": mp.get_start_method()}


def forks_while_loading(rank: int, world: int) -> dict:
    loader = ShmLoader(
        ranks.make_loader_factory(2, n=8), dist.group.WORLD, config=Config.from_env(enabled=False)
    )
    try:
        return _load_recording_forks(lambda: loader)
    finally:
        loader.close()


def test_dataloader_workers_never_fork_a_threaded_process() -> None:
    ctx = zmq.Context()  # what an in-process test leaves behind: an I/O thread
    ctx.socket(zmq.PAIR).close()
    try:
        here = _load_recording_forks(ranks.make_loader_factory(2, n=8))
    finally:
        ctx.term()
    assert here["seen"] == 4 and here["threads"] > 1
    assert here["forks"] == [], f"the test process forked with {here['forks']} threads"

    for rank, o in enumerate(run_ranks(forks_while_loading, 2)):
        assert o["seen"] == 4 and o["threads"] > 1
        assert o["method"] == "forkserver", f"rank {rank} starts workers by {o['method']}"
        assert o["forks"] == [], f"rank {rank} forked with {o['forks']} threads"


# ------------------------------------------------- descriptors in forked children


def _shml_descriptors(pid: int | str) -> list[str]:
    """Targets of ``pid``'s open descriptors that are shmloader segments."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if "/shml-" in target:
            found.append(target)
    return found


def _holders(pid: int | str, name: str) -> int:
    """How many descriptors and mappings of ``pid`` refer to segment ``name``."""
    stem = name.lstrip("/")
    with open(f"/proc/{pid}/maps") as f:
        mapped = sum(stem in line for line in f)
    return mapped + sum(stem in t for t in _shml_descriptors(pid))


@pytest.mark.timeout(30)
def test_a_forked_child_holds_no_segment_descriptor_and_retired_slots_are_freed() -> None:
    """NOTE [no inherited descriptors] (segment): neither a ``Segment``'s own
    descriptor nor the duplicate a mapping would keep reaches a forked child,
    so a slot the parent retires while the child lives is held by nobody."""
    from shmloader._node import segment
    from shmloader._node.ring import RingReader, RingWriter, new_token
    from shmloader._node.segment import KIND_DATA, Segment

    token = new_token()
    w = RingWriter(token, frozenset({1}), {"job": "t"})
    r = RingReader(token)
    rfd, wfd = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = orphan_fd = -1
    try:
        slot = w.acquire(1 << 20)
        name = slot.segment.name
        r.open(name)
        view = r.view(name, 1 << 20, lambda: None)  # a reader's batch, alive at the fork
        # a segment dropped without close(): its descriptor stays open, held by nobody
        dropped = Segment.create_unique(f"/shml-{token}-dropped", KIND_DATA, token, 4096)
        orphan_fd, orphan_name = dropped.fd, dropped.name
        del dropped
        gc.collect()
        assert _shml_descriptors("self"), "the parent holds its segments open"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child: lives on until told
            os.write(ready_w, b"r")  # the fork handlers have run by now
            os.read(rfd, 1)
            os._exit(0)
        assert os.read(ready_r, 1) == b"r"
        assert _shml_descriptors(pid) == [], "a forked child holds segment descriptors"
        # The parent retires the slot (grows it) and drops the batch: with no
        # holder left anywhere, the kernel frees the slot's memory now.
        slot.state = type(slot.state).FREE
        w.acquire(4 << 20)  # too big for the free slot: it is replaced
        assert w.slots[0].segment.name != name
        r.forget(name)
        del view
        assert _holders("self", name) == 0
        assert _holders(pid, name) == 0, "the child still pins the retired slot"
        assert _shml_descriptors(pid) == []
    finally:
        os.write(wfd, b"x")
        for fd in (rfd, wfd, ready_r, ready_w):
            os.close(fd)
        if pid > 0:
            os.waitpid(pid, 0)
        if orphan_fd >= 0:
            os.close(orphan_fd)
            segment.unlink_name(orphan_name)
        r.close()
        w.close()


# ------------------------------------------------- a delivered batch crosses a fork


class _Rows(torch.utils.data.Dataset):
    """Rows of 64 KiB, each filled with its index: a batch is a slot view, not a small leaf."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((16384,), float(i))}


class _Holding(torch.utils.data.Dataset):
    """An eval dataset holding a delivered tensor (its rows are read in the worker)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i].clone()


def _read_when_told(x: torch.Tensor, conn) -> None:  # pragma: no cover - forked child
    if conn.poll(60):  # the parent has dropped the batch and moved on by now
        conn.recv()
    conn.send(x.tolist())  # plain values: no tensor through the pipe
    conn.close()


def batch_across_fork(rank: int, world: int, *, num_workers: int, share: bool) -> dict:
    from shmloader._node.views import view_source

    fork = mp.get_context("fork")
    loader = ShmLoader(
        lambda: torch.utils.data.DataLoader(_Rows(), batch_size=4, num_workers=num_workers),
        dist.group.WORLD,
        config=Config.from_env(enabled=share, slots=2, small_copy_bytes=0),
    )
    it = iter(loader)
    batch = next(it)
    x = batch["x"]
    want = x.clone()
    in_slot = view_source(x.data_ptr()) is not None
    parent_end, child_end = fork.Pipe()
    child = fork.Process(target=_read_when_told, args=(x, child_end))
    child.start()
    child_end.close()
    evaluated = torch.utils.data.DataLoader(
        _Holding(x), batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    evald = torch.cat(list(evaluated))
    del batch, x, evaluated
    gc.collect()
    rest = [b["x"][:, 0].tolist() for b in it]  # the slot of the first batch is rewritten
    parent_end.send("go")
    got = parent_end.recv() if parent_end.poll(60) else None
    child.join(60)
    loader.close()
    return {
        "in_slot": in_slot,
        "exitcode": child.exitcode,
        "proc": got == want.tolist(),
        "eval": torch.equal(evald, want),
        "rest": rest,
    }


def batch_across_fork_both(rank: int, world: int, *, num_workers: int) -> dict:
    return {
        share: batch_across_fork(rank, world, num_workers=num_workers, share=share)
        for share in (False, True)
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_delivered_batch_is_read_in_forked_children_as_a_plain_tensor_is(num_workers) -> None:
    """NOTE [batches cross a fork] (forks): a ``multiprocessing`` fork child and an
    eval DataLoader's fork worker read the batch the parent held at the fork, also
    after the parent dropped it and the writer rewrote its slot, on every rank."""
    out = run_ranks(batch_across_fork_both, 2, kwargs={"num_workers": num_workers}, timeout=150)
    for rank, o in enumerate(out):
        assert o[True]["in_slot"], f"rank {rank}: the batch is no slot view: nothing tested"
        for share, r in o.items():
            where = f"rank {rank}, sharing {'on' if share else 'off'}"
            assert r["exitcode"] == 0, f"{where}: the forked child exited {r['exitcode']}"
            assert r["proc"], f"{where}: the forked child read other bytes than the batch's"
            assert r["eval"], f"{where}: the eval worker read other bytes than the batch's"
            assert r["rest"] == [[4.0 * b + i for i in range(4)] for b in (1, 2, 3)]


_FORK_IN_OWN_DIR = """
import gc, os
from shmloader._node import segment
from shmloader._node.segment import KIND_DATA, Segment

assert segment.SHM_DIR == os.environ["SHMLOADER_SHM_DIR"] != "/dev/shm", segment.SHM_DIR
kept = Segment.create_unique("/shml-0123456789abcdef-kept", KIND_DATA, "0123456789abcdef", 4096)
dropped = Segment.create_unique("/shml-0123456789abcdef-drop", KIND_DATA, "0123456789abcdef", 4096)
orphan, orphan_name = dropped.fd, dropped.name
del dropped  # its descriptor stays open, held by no Segment: only the /proc scan finds it
gc.collect()

def held():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/shml-" in target:
            found.append(target)
    return found

before = len(held())
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, str(len(held())).encode())
    os._exit(0)
os.close(w)
in_child = int(os.read(r, 16))
os.waitpid(pid, 0)
kept.unlink()
kept.close()
os.close(orphan)
segment.unlink_name(orphan_name)
print(before, in_child)
"""


def test_a_forked_child_holds_no_descriptor_of_a_ring_directory_that_is_not_dev_shm(
    tmp_path,
) -> None:
    """NOTE [no inherited descriptors] (segment): the child's scan of its descriptors
    looks in the process's ring directory (``SHMLOADER_SHM_DIR``), not in /dev/shm."""
    import subprocess
    import sys

    ring = tmp_path / "ring"
    ring.mkdir(mode=0o700)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        SHMLOADER_SHM_DIR=str(ring),
        PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "daemon")]),
    )
    done = subprocess.run(
        [sys.executable, "-c", _FORK_IN_OWN_DIR],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    before, in_child = (int(x) for x in done.stdout.split())
    assert before == 2, "the parent holds both segments open"
    assert in_child == 0, f"a forked child holds {in_child} descriptor(s) of segments in {ring}"
    assert os.listdir(ring) == []


# ------------------------------------------------- forks that race, forks under a limit


def _scenario(*args: object) -> dict:
    """``tests.support.forking`` in a fresh interpreter (it forks from several threads)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "daemon")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.forking", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=repo,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("threads", "per_thread", "later"), [(2, 40, 0), (8, 25, 0), (8, 25, 1)])
def test_forks_from_many_threads_at_once_give_every_child_the_batch_it_inherited(
    threads, per_thread, later
) -> None:
    """NOTE [batches cross a fork] (forks): threads fork at the same time while another
    maps new views; every child reads the view it inherited as the parent held it,
    after the parent dropped it and the slot was rewritten, and no fork waits for
    another fork's child (the scenario waits 10 s at most for a child's copy).
    ``later``: leased views, lent from the slot's standing mapping while it is free
    (NOTE [a standing mapping])."""
    out = _scenario("racing", threads, per_thread, 1 << 20, later)
    n = threads * per_thread
    assert out["children"] == n
    assert out["read_other"] == 0, f"{out['read_other']} of {n} children read the rewritten slot"
    assert out["signalled"] == 0 and out["other"] == 0, out
    assert out["read_batch"] == n
    assert out["warnings"] == [], out["warnings"]
    assert out["longest_fork_s"] < 10.0, f"an os.fork() waited {out['longest_fork_s']:.1f} s"


def test_os_fork_returns_once_the_child_has_its_copy() -> None:
    """The parent drops a 64 MiB batch and its slot is rewritten the moment ``os.fork``
    returns: the child, copying in its fork handler, must have finished by then."""
    for _ in range(3):
        out = _scenario("limited", 64 << 20, 0)
        assert out["read_batch"] == 1, out
        assert not out["held_for_child"] and out["warnings"] == [], out


@pytest.mark.parametrize("later", [0, 1])
def test_a_child_under_an_address_space_limit_copies_its_batch_in_pieces(later) -> None:
    """Room for 16 MiB more, a 64 MiB batch: the copy is made 2 MiB at a time; the
    child reads its batch after the parent released the slot and it was rewritten."""
    out = _scenario("limited", 64 << 20, 16 << 20, later)
    assert out["signalled"] == 0, "the child died of a signal reading its batch"
    assert out["read_batch"] == 1, out
    assert not out["held_for_child"], "the copy failed: the slot stayed held for the child"
    assert out["warnings"] == [], out["warnings"]


@pytest.mark.parametrize("later", [0, 1])
def test_a_child_that_cannot_copy_reads_its_batch_from_a_slot_held_until_it_exits(later) -> None:
    """No room for even a piece: the child reads the view it inherited, never a fault;
    the parent keeps the slot from reuse until the child is gone, and says so once.
    ``later``: the batch is lent from its slot's standing mapping."""
    out = _scenario("limited", 64 << 20, 1_000_000, later)
    assert out["signalled"] == 0, "the child died of a signal reading its batch"
    assert out["read_batch"] == 1, out
    assert out["held_for_child"], "the slot was released while the child still maps it"
    assert out["released_after"], "the slot stayed held after the child was gone"
    assert len(out["warnings"]) == 1 and "could not copy" in out["warnings"][0], out


def test_a_batch_of_a_standing_mapping_crosses_a_fork_and_leaves_no_write_behind() -> None:
    """NOTE [a standing mapping] (standing): a held batch lent from its slot's standing
    mapping, written into, reaches a forked child as the parent had it, and the child
    maps no slot at all (not the rest of the standing mapping either, nor does a later
    fork); once the batch is dropped, the slot's next batch through the same mapping
    shows none of the write."""
    out = _scenario("standing", 4 << 20)
    assert out["read_batch"] == 2 and out["signalled"] == 0, out
    assert out["child_read"], "the child did not read the batch it held at the fork"
    assert out["child_slots"] == [], f"the child maps slots: {out['child_slots']}"
    # the rest of the standing mapping is held in the child, inaccessible (forks.NOT_FORKED)
    assert out["child_past"] == "---p", f"past the batch in the child: {out['child_past']!r}"
    assert out["later_child_slots"] == [], (
        "a later fork inherited the range passed down to an earlier one"
    )
    assert out["released"], "the dropped batch was not released"
    assert out["same_mapping"], "the next batch was not lent from the standing mapping"
    assert out["next_batch"], "the next batch shows the previous batch's write"


def _mapping_kind(maps: str, addr: int) -> str:
    """What backs ``addr`` in a ``/proc/<pid>/maps`` text."""
    for line in maps.splitlines():
        fields = line.split()
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= addr < end:
            path = fields[5] if len(fields) > 5 else ""
            if "shml-" in path:
                return "slot"
            if fields[1].startswith("---"):
                return "inaccessible"
            return "copy" if fields[1].startswith("rw") and fields[4] == "0" else line
    return "unmapped"


def views_at_fork(rank: int, world: int) -> dict:
    """Hold one batch while the loop has 2 queued ahead (3 slots), fork, and tell what
    backs each live batch view in the child."""
    from shmloader._node import forks

    loader = ShmLoader(
        lambda: torch.utils.data.DataLoader(_Rows(), batch_size=4, num_workers=2),
        dist.group.WORLD,
        config=Config.from_env(enabled=True, slots=3, small_copy_bytes=0),
    )
    it = iter(loader)
    batch = next(it)
    ptr = batch["x"].data_ptr()
    deadline = time.monotonic() + 30
    while loader.stats().get("ahead_ready", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    queued = loader.stats().get("ahead_ready", 0)
    views = {a: n for a, (ref, n) in forks.COPY_AT_FORK.items() if ref() is not None}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: says what it maps, and nothing else
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
            os.write(write, json.dumps([_mapping_kind(maps, a) for a in views]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        kinds = dict(zip(views, json.loads(f.read()), strict=True))
    os.waitpid(pid, 0)
    held = [kinds[a] for a, n in views.items() if a <= ptr < a + n]
    others = sorted(kinds[a] for a, n in views.items() if not a <= ptr < a + n)
    del batch
    rest = sum(1 for _ in it)
    loader.close()
    return {"queued": queued, "held": held, "others": others, "rest": rest}


@pytest.mark.timeout(150)
def test_a_fork_copies_the_batch_user_code_holds_and_drops_what_the_loop_queued() -> None:
    """NOTE [batches cross a fork] (forks): the batches a loop running ahead has queued
    (or waits to queue) are no user code's; the child gets them neither copied nor
    mapped, and gets its own copy of the batch the user holds."""
    out = run_ranks(views_at_fork, 2, timeout=120)
    for rank, o in enumerate(out):
        assert o["queued"] == 2, f"rank {rank}: the loop did not queue 2 batches: nothing tested"
        assert o["held"] == ["copy"], f"rank {rank}: the held batch in the child: {o['held']}"
        # the 2 queued, and on the leader the next one its loop waits to queue
        others = o["others"]
        assert len(others) >= 2 and set(others) == {"inaccessible"}, f"rank {rank}: {others}"
        assert o["rest"] == 3


def test_a_denied_view_faults_on_touch_instead_of_raising() -> None:
    # forks._deny, what a child does with a view only a loop ahead held: the range
    # becomes inaccessible (a fault on touch), and the call itself must not raise
    code = (
        "import ctypes, mmap\n"
        "from shmloader._node import forks\n"
        "m = mmap.mmap(-1, mmap.PAGESIZE)\n"
        "addr = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
        "forks._deny(addr, mmap.PAGESIZE)\n"
        "print('denied', flush=True)\n"
        "ctypes.string_at(addr, 1)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "daemon")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.strip() == "denied", out.stderr[-2000:]
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])
