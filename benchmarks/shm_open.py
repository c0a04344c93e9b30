"""``posix_ipc`` against shmloader's own ``/dev/shm`` files: cost, and what each guarantees.

The design card names ``posix_ipc`` (``shm_open`` and friends); shmloader
opens the files of its ring directory itself (``shmloader._node.segment``).
``python -m benchmarks.shm_open [--n 2000] [--mib 1 64] [--trips 1000] [--out DIR]``
measures both, per segment size, three ways::

    posix_ipc        posix_ipc.SharedMemory: shm_open(O_CREAT|O_EXCL) + ftruncate;
                     an attach is shm_open(O_RDWR) + fstat; mmap.mmap of its fd
    open+ftruncate   what posix_ipc does, from Python with shmloader's open flags
                     (O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC): the system calls' share alone
    open+fallocate   the same with posix_fallocate: shmloader's calls without its Python
    shmloader        segment.Segment.create_unique (open, fchmod, posix_fallocate, the
                     header), Segment.attach (open_checked + validate), map_shared

and per operation, each timed alone (``--n`` times, the ways taking turns)::

    create   exclusive create of a sized segment, close, unlink
    attach   open of an existing segment (validated, for shmloader), close
    touch    create, map, every page faulted in for writing (MADV_POPULATE_WRITE, as
             the ring's slots are), unmap, close, unlink (fewer times at large sizes)

Then the facts, each tested, not read from documentation (a child process in
a private mount namespace where root: a ``huge=within_size`` tmpfs for the
huge-page ring, a 4 MiB tmpfs over ``/dev/shm`` for the full-directory
test): whether a way can create in a directory of its choosing, refuses a
symlink or a FIFO planted at the name, checks owner and mode, keeps its
descriptor out of exec'd and forked children and out of its mappings, and
fails at create (not with SIGBUS at first write) when the directory is full.

And the signalling jobs ``posix_ipc``'s other objects could take: a
cross-process wake-up round trip (``--trips``) by two ``posix_ipc.Semaphore``,
two ``posix_ipc.MessageQueue`` and a ZeroMQ ``PAIR`` over ``ipc://`` (what
shmloader's channel uses, with XPUB/ROUTER); the uncontended lock and unlock
of a pool partition (``fcntl.lockf`` on a byte of the control segment, what
``shmloader._workers.partition`` does) against a semaphore; and whether each lock
is given back when its holder is killed. Writes ``shm_open.json`` and
``shm_open.md`` to ``--out`` (default a new temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import provenance

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = {
    "posix_ipc": "posix_ipc.SharedMemory (shm_open + ftruncate; attach: shm_open + fstat); "
    "mmap.mmap of its descriptor",
    "open+ftruncate": "os.open with shmloader's flags (O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC, "
    "O_CREAT|O_EXCL to create) + ftruncate; attach: open + fstat; mmap.mmap",
    "open+fallocate": "the same with posix_fallocate for ftruncate: shmloader's system calls "
    "without its Python (create and touch only; its attach is open+ftruncate's)",
    "shmloader": "segment.Segment.create_unique (open, fchmod 0600, posix_fallocate, header "
    "written), Segment.attach (open_checked + validate), Segment.map_shared",
}
OPS = {
    "create": "exclusive create of a sized segment, close, unlink",
    "attach": "open an existing segment (shmloader: validated), close",
    "touch": "create, map, fault every page in for writing, unmap, close, unlink",
}
#: Name prefixes: ``shml-`` is shmloader's own (its at-fork hook closes descriptors of
#: such files); posix_ipc's and the plain syscalls' names stay clear of it.
STEM = f"shml-bench{os.getpid()}"
OTHER = f"pipcbench{os.getpid()}"
FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _posix_ipc() -> Any:
    try:
        import posix_ipc
    except ImportError:
        raise SystemExit(
            "benchmarks.shm_open needs posix_ipc: .venv/bin/pip install posix_ipc "
            "(the test extra has it: ./setup.sh)"
        ) from None
    return posix_ipc


# ------------------------------------------------------------------ segment cost


def _us(ns: list[int]) -> dict[str, float]:
    ns = sorted(ns)
    return {
        "p50_us": statistics.median(ns) / 1e3,
        "p90_us": ns[min(len(ns) - 1, int(0.9 * len(ns)))] / 1e3,
        "mean_us": statistics.fmean(ns) / 1e3,
        "n": len(ns),
    }


class Ways:
    """The three ways' create / attach / touch, each one call that cleans up after itself."""

    def __init__(self, size: int) -> None:
        from shmloader._node import mapping, segment

        self.pi = _posix_ipc()
        self.seg = segment
        self.touch = mapping.touch
        self.size = size
        self.count = 0
        self.capacity = size - segment.HEADER_SIZE  # the same file size every way

    def _name(self) -> str:
        self.count += 1
        return f"/{OTHER}-{self.count}"

    # posix_ipc
    def pi_create(self) -> None:
        shm = self.pi.SharedMemory(self._name(), self.pi.O_CREX, mode=0o600, size=self.size)
        shm.close_fd()
        shm.unlink()

    def pi_attach(self, name: str) -> None:
        self.pi.SharedMemory(name).close_fd()

    def pi_touch(self) -> None:
        shm = self.pi.SharedMemory(self._name(), self.pi.O_CREX, mode=0o600, size=self.size)
        mm = mmap.mmap(shm.fd, self.size)
        self.touch(mm)
        mm.close()
        shm.close_fd()
        shm.unlink()

    # the same system calls as posix_ipc, shmloader's flags
    def _os_make(self, allocate: bool) -> tuple[int, str]:
        """A new sized file with shmloader's flags: (descriptor, path)."""
        path = "/dev/shm" + self._name()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | FLAGS, 0o600)
        if allocate:
            os.posix_fallocate(fd, 0, self.size)
        else:
            os.ftruncate(fd, self.size)
        return fd, path

    def os_create(self, allocate: bool = False) -> None:
        fd, path = self._os_make(allocate)
        os.close(fd)
        os.unlink(path)

    def os_attach(self, name: str) -> None:
        fd = os.open("/dev/shm" + name, os.O_RDWR | FLAGS)
        os.fstat(fd)
        os.close(fd)

    def os_touch(self, allocate: bool = False) -> None:
        fd, path = self._os_make(allocate)
        mm = mmap.mmap(fd, self.size)
        self.touch(mm)
        mm.close()
        os.close(fd)
        os.unlink(path)

    # shmloader's segment code
    def shml_create(self) -> None:
        s = self.seg.Segment.create_unique(f"/{STEM}-d", self.seg.KIND_DATA, "bench", self.capacity)
        s.close()
        s.unlink()

    def shml_attach(self, name: str) -> None:
        self.seg.Segment.attach(name, kind=self.seg.KIND_DATA, token="bench").close()

    def shml_touch(self) -> None:
        s = self.seg.Segment.create_unique(f"/{STEM}-d", self.seg.KIND_DATA, "bench", self.capacity)
        mm = s.map_shared()
        self.touch(mm)
        mm.close()
        s.close()
        s.unlink()


def measure_size(mib: float, n: int) -> list[dict[str, Any]]:
    """Rows (op, mib, way, p50/p90/mean us, n) of one segment size; the ways take turns."""
    size = int(mib * MiB)
    w = Ways(size)
    pi_name = f"/{OTHER}-attach"
    kept_pi = w.pi.SharedMemory(pi_name, w.pi.O_CREX, mode=0o600, size=size)
    kept = w.seg.Segment.create_unique(f"/{STEM}-a", w.seg.KIND_DATA, "bench", w.capacity)
    calls: dict[str, dict[str, Callable[[], None]]] = {
        "create": {"posix_ipc": w.pi_create, "open+ftruncate": w.os_create,
                   "open+fallocate": lambda: w.os_create(True), "shmloader": w.shml_create},
        "attach": {"posix_ipc": lambda: w.pi_attach(pi_name),
                   "open+ftruncate": lambda: w.os_attach(pi_name),
                   "shmloader": lambda: w.shml_attach(kept.name)},
        "touch": {"posix_ipc": w.pi_touch, "open+ftruncate": w.os_touch,
                  "open+fallocate": lambda: w.os_touch(True), "shmloader": w.shml_touch},
    }  # fmt: skip
    rows = []
    try:
        for op, ways in calls.items():
            times: dict[str, list[int]] = {k: [] for k in ways}
            count = n if op != "touch" else min(n, max(10, int(4096 // max(mib, 1))))
            order = list(ways)
            for _ in range(3):  # warm-up: imports, the first faults of the interpreter
                for fn in ways.values():
                    fn()
            for i in range(count):
                turn = i % len(order)
                for way in order[turn:] + order[:turn]:
                    t0 = time.perf_counter_ns()
                    ways[way]()
                    times[way].append(time.perf_counter_ns() - t0)
            for way, ns in times.items():
                rows.append({"op": op, "mib": mib, "way": way, **_us(ns)})
    finally:
        kept_pi.close_fd()
        kept_pi.unlink()
        kept.close()
        kept.unlink()
    return rows


# ------------------------------------------------------------------- the facts


CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 16384, 1 << 18


def _mount_tmpfs(path: str, options: str) -> str | None:
    """Mount a tmpfs at ``path`` (this private namespace only); None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options.encode()) != 0:
        return f"mount -t tmpfs -o {options} {path}: {os.strerror(ctypes.get_errno())}"
    return None


def _private_namespace() -> str | None:
    if os.geteuid() != 0:
        return "needs root (tmpfs mounts in a private mount namespace)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    return None


def _fd_count(path: str) -> int:
    """How many descriptors of this process refer to ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == path
    return n


def _in_child(fn: Callable[[], int]) -> int:
    """Run ``fn`` in a forked child; its exit status (negative: killed by that signal)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160]


def facts_child() -> None:
    """Every fact of the table, tested; one JSON object on stdout (run in a fresh process)."""
    why_not = _private_namespace()  # first: before any thread exists
    pi = _posix_ipc()
    from shmloader._node import mapping, ringdir, segment
    from shmloader.errors import ProtocolError, ShmCapacityError

    S = segment
    facts: list[dict[str, str]] = []

    def fact(question: str, pi_says: str, shml_says: str) -> None:
        facts.append({"question": question, "posix_ipc": pi_says, "shmloader": shml_says})

    def shml_create(capacity: int = 1 << 20) -> Any:
        return S.Segment.create_unique(f"/{STEM}-f", S.KIND_DATA, "bench", capacity)

    # a symlink planted at the name: pointing at a segment of ours, so that only the
    # link itself can be the reason for a refusal
    target = shml_create()
    link = f"{OTHER}-link"
    os.symlink(target.name.lstrip("/"), f"/dev/shm/{link}")
    try:
        try:
            pi.SharedMemory("/" + link).close_fd()
            p = "no: opened the link's target"
        except OSError as exc:
            p = f"yes ({errno.errorcode.get(exc.errno, exc.errno)}: glibc's shm_open adds " \
                "O_NOFOLLOW)"  # fmt: skip
        try:
            S.Segment.attach("/" + link, kind=S.KIND_DATA, token="bench").close()
            s = "no: opened the link's target"
        except ProtocolError as exc:
            s = f"yes (O_NOFOLLOW: {exc})"
        fact("refuses a symlink planted at the name (open)", p, s)
        try:
            pi.SharedMemory("/" + link, pi.O_CREX, size=4096)
            p = "no: created through the link"
        except pi.ExistentialError:
            p = "yes (O_CREAT|O_EXCL: EEXIST)"
        s = "yes (O_CREAT|O_EXCL|O_NOFOLLOW; create_unique draws another random name)"
        fact("refuses a symlink planted at the name (create)", p, s)
    finally:
        os.unlink(f"/dev/shm/{link}")
        target.close()
        target.unlink()

    # a FIFO planted at the name: opened read-only (a reader's open)
    fifo = f"{OTHER}-fifo"
    os.mkfifo(f"/dev/shm/{fifo}", 0o600)
    try:

        def pi_fifo() -> int:
            signal.alarm(1)  # SIGALRM's default action ends the child: the open blocked
            pi.SharedMemory("/" + fifo, read_only=True).close_fd()
            return 0

        code = _in_child(pi_fifo)
        p = "no: the open blocked (killed after 1 s)" if code == -signal.SIGALRM else \
            f"yes (exit {code})"  # fmt: skip

        def shml_fifo() -> int:
            signal.alarm(1)
            try:
                S.open_checked("/" + fifo)
            except ProtocolError:
                return 0
            return 3

        code = _in_child(shml_fifo)
        s = "yes (O_NONBLOCK, then fstat: not a regular file)" if code == 0 else \
            f"no (exit {code})"  # fmt: skip
        fact("a FIFO planted at the name cannot block a read-only open", p, s)
    finally:
        os.unlink(f"/dev/shm/{fifo}")

    # a segment of our uid with mode 0666 (anyone could have written it)
    loose = shml_create()
    os.fchmod(loose.fd, 0o666)
    try:
        shm = pi.SharedMemory(loose.name)
        p = "no: opened; the caller must fstat its .fd itself"
        shm.close_fd()
        try:
            S.Segment.attach(loose.name, kind=S.KIND_DATA, token="bench").close()
            s = "no"
        except ProtocolError as exc:
            s = f"yes, fstat before a byte is read ({exc})"
        fact("checks owner and mode before reading", p, s)
    finally:
        loose.close()
        loose.unlink()

    # descriptors: exec, fork, mappings
    shm = pi.SharedMemory(f"/{OTHER}-fd", pi.O_CREX, mode=0o600, size=1 << 20)
    seg = shml_create()
    pi_path, shml_path = f"/dev/shm/{OTHER}-fd", S.shm_path(seg.name)
    try:
        probe = "import os,sys; os.fstat(int(sys.argv[1]))"
        left = {}
        for way, fd in (("posix_ipc", shm.fd), ("shmloader", seg.fd)):
            run = subprocess.run([sys.executable, "-c", probe, str(fd)], close_fds=False,
                                 capture_output=True)  # fmt: skip
            left[way] = "yes (O_CLOEXEC)" if run.returncode else "no: the exec'd program has it"
        fact("descriptor closed in an exec'd program", left["posix_ipc"], left["shmloader"])

        def still_open(fd: int) -> Callable[[], int]:
            def check() -> int:
                try:
                    os.fstat(fd)
                except OSError:
                    return 0
                return 1

            return check

        p = "no: the child holds it (and the segment's pages) until it exits or closes it" \
            if _in_child(still_open(shm.fd)) else "yes"  # fmt: skip
        s = "yes (os.register_at_fork closes every Segment's, and any shml-* file's of the " \
            "ring directory)" if _in_child(still_open(seg.fd)) == 0 else "no"  # fmt: skip
        fact("descriptor closed in a forked child", p, s)

        mm_pi = mmap.mmap(shm.fd, 1 << 20)
        shm.close_fd()
        mm_s = seg.map_shared()
        seg.close()
        p = f"no: mmap.mmap keeps a duplicate ({_fd_count(pi_path)} left after close_fd)"
        s = f"yes (mapping.map_fd: {_fd_count(shml_path)} left after close)"
        fact("a mapping holds no descriptor of the segment", p, s)
        mm_pi.close()
        mm_s.close()
    finally:
        shm.unlink()
        seg.close()
        seg.unlink()

    # the directory: a huge-page tmpfs
    huge = tempfile.mkdtemp(prefix="shml-bench-huge-")
    mounted = None if why_not else _mount_tmpfs(huge, "huge=within_size,size=64m,mode=1777")
    try:
        try:
            pi.SharedMemory(huge + "/x", pi.O_CREX, size=4096)
            p = "made (unexpected)"
        except (ValueError, OSError) as exc:
            p = f"no: shm_open takes a name, not a path ({_err(exc)}); glibc puts every " \
                "name in /dev/shm"  # fmt: skip
        if why_not or mounted:
            s = f"yes (SHMLOADER_SHM_DIR; not tested here: {why_not or mounted})"
        else:
            facts_huge = ringdir.describe(huge)
            with S.in_dir(huge):
                seg = shml_create(4 * MiB - S.HEADER_SIZE)
                mm = seg.map_shared()
                mapping.touch(mm)
                pmd = _pmd_kb(mm)
                mm.close()
                seg.close()
                seg.unlink()
            s = f"yes: {pmd} of {4 * 1024} kB of a touched 4 MiB segment mapped by 2 MiB " \
                f"page-table entries (ringdir: {facts_huge.why})"  # fmt: skip
        fact("creates in a directory of its choosing (a huge=within_size tmpfs)", p, s)
    finally:
        with contextlib.suppress(OSError):
            ctypes.CDLL(None).umount2(huge.encode(), 2)
        with contextlib.suppress(OSError):
            os.rmdir(huge)

    # a full directory: a 4 MiB tmpfs over /dev/shm, a 16 MiB segment
    question = "a full directory fails at create, not with SIGBUS at the first write"
    mounted = None if why_not else _mount_tmpfs("/dev/shm", "size=4m,mode=1777")
    if why_not or mounted:
        fact(question, f"not tested: {why_not or mounted}", f"not tested: {why_not or mounted}")
    else:
        try:
            shm = pi.SharedMemory(f"/{OTHER}-full", pi.O_CREX, mode=0o600, size=16 * MiB)
        except OSError as exc:
            p = f"yes ({_err(exc)})"
        else:
            mm = mmap.mmap(shm.fd, 16 * MiB)
            shm.close_fd()

            def write_all() -> int:
                for off in range(0, len(mm), mmap.PAGESIZE):
                    mm[off] = 1
                return 0

            code = _in_child(write_all)
            mm.close()
            shm.unlink()
            p = "no: created (ftruncate allocates nothing); the writer was killed by " \
                f"{signal.Signals(-code).name if code < 0 else f'nothing (exit {code})'} " \
                "at its first page past 4 MiB"  # fmt: skip
        try:
            shml_create(16 * MiB).unlink()
            s = "no: created"
        except ShmCapacityError as exc:
            s = f"yes (posix_fallocate: ShmCapacityError: {str(exc)[:90]})"
        fact(question, p, s)
    print(json.dumps({"facts": facts, "namespace": why_not or "private mount namespace"}))


def _pmd_kb(mm: mmap.mmap) -> int:
    from shmloader._node import forks

    from .hugedir import mapping_of

    m = mapping_of(forks.address(mm))
    return m.get("ShmemPmdMapped", 0) + m.get("FilePmdMapped", 0)


def facts() -> dict[str, Any]:
    """``facts_child`` in a fresh process (its mount namespace goes with it)."""
    run = subprocess.run(
        [sys.executable, "-c", "import benchmarks.shm_open as b; b.facts_child()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the facts child failed ({run.returncode}): {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------- signalling


def peer(kind: str, name: str, trips: int) -> None:
    """The other process of a round trip: waits for each ping and answers it."""
    if kind == "zmq":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(name)
        for _ in range(trips):
            sock.send(sock.recv())
        sock.close()
        ctx.term()
        return
    pi = _posix_ipc()
    if kind == "sem":
        ping, pong = pi.Semaphore(name + "-ping"), pi.Semaphore(name + "-pong")
        for _ in range(trips):
            ping.acquire(10)
            pong.release()
    elif kind == "mq":
        ping, pong = pi.MessageQueue(name + "-ping"), pi.MessageQueue(name + "-pong")
        for _ in range(trips):
            pong.send(ping.receive(10)[0])
    elif kind == "hold":  # takes the semaphore and the lock, says so, waits to be killed
        sem = pi.Semaphore(name)
        sem.acquire(10)
        fd = os.open(f"/dev/shm{name}-lock", os.O_RDWR | FLAGS)
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
        print("held", flush=True)
        time.sleep(60)


def _start_peer(kind: str, name: str, trips: int) -> subprocess.Popen:
    code = f"import benchmarks.shm_open as b; b.peer({kind!r}, {name!r}, {trips})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip


def round_trips(kind: str, trips: int, warmup: int = 50) -> list[int]:
    """ns per round trip (ping, the peer wakes and answers, this process wakes)."""
    pi = _posix_ipc()
    name = f"/{OTHER}-{kind}"
    made: list[Any] = []
    ctx = None
    try:
        if kind == "zmq":
            import zmq

            ctx = zmq.Context()
            sock = ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            where = f"ipc://{tempfile.gettempdir()}/{OTHER}-zmq.sock"
            sock.bind(where)
            made.append(sock)
            ping, pong = (lambda: sock.send(b"x")), sock.recv
            proc = _start_peer(kind, where, warmup + trips)
        elif kind == "sem":
            a = pi.Semaphore(name + "-ping", pi.O_CREX, initial_value=0)
            b = pi.Semaphore(name + "-pong", pi.O_CREX, initial_value=0)
            made += [a, b]
            ping, pong = a.release, (lambda: b.acquire(10))
            proc = _start_peer(kind, name, warmup + trips)
        else:
            a = pi.MessageQueue(name + "-ping", pi.O_CREX, max_messages=1, max_message_size=64)
            b = pi.MessageQueue(name + "-pong", pi.O_CREX, max_messages=1, max_message_size=64)
            made += [a, b]
            ping, pong = (lambda: a.send(b"x")), (lambda: b.receive(10))
            proc = _start_peer(kind, name, warmup + trips)
        out = []
        for i in range(warmup + trips):
            t0 = time.perf_counter_ns()
            ping()
            pong()
            if i >= warmup:
                out.append(time.perf_counter_ns() - t0)
        proc.wait(30)
        return out
    finally:
        if kind == "zmq":
            with contextlib.suppress(OSError):
                os.unlink(f"{tempfile.gettempdir()}/{OTHER}-zmq.sock")
        for obj in made:
            if kind == "zmq":
                obj.close()
            else:
                obj.unlink()
                with contextlib.suppress(Exception):
                    obj.close()
        if ctx is not None:
            ctx.term()


def lock_pairs(n: int) -> dict[str, list[int]]:
    """ns per uncontended lock + unlock: fcntl.lockf on a byte (the pool's), a semaphore."""
    pi = _posix_ipc()
    path = f"/dev/shm/{OTHER}-lockf"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | FLAGS, 0o600)
    sem = pi.Semaphore(f"/{OTHER}-lock", pi.O_CREX, initial_value=1)
    out: dict[str, list[int]] = {"fcntl.lockf": [], "posix_ipc.Semaphore": []}
    try:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
            t1 = time.perf_counter_ns()
            sem.acquire()
            sem.release()
            t2 = time.perf_counter_ns()
            out["fcntl.lockf"].append(t1 - t0)
            out["posix_ipc.Semaphore"].append(t2 - t1)
    finally:
        os.close(fd)
        os.unlink(path)
        sem.unlink()
        sem.close()
    return out


def killed_holder() -> dict[str, str]:
    """Whether each lock comes free when the process holding it is SIGKILLed."""
    pi = _posix_ipc()
    name = f"/{OTHER}-held"
    sem = pi.Semaphore(name, pi.O_CREX, initial_value=1)
    fd = os.open(f"/dev/shm{name}-lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | FLAGS, 0o600)
    try:
        proc = _start_peer("hold", name, 0)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "held":
            raise RuntimeError(f"the holder did not say held: {line!r}")
        proc.kill()
        proc.wait(10)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            lockf = "yes: the kernel drops a dead process's record locks"
        except OSError:
            lockf = "no"
        try:
            sem.acquire(0.5)
            semaphore = "yes"
        except pi.BusyError:
            semaphore = "no: still taken after 0.5 s (a dead holder's count is never given back)"
        return {"fcntl.lockf": lockf, "posix_ipc.Semaphore": semaphore}
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm{name}-lock")
        sem.unlink()
        sem.close()


def mqueue_limits() -> str:
    got = []
    for key in ("msg_max", "msgsize_max", "queues_max"):
        with contextlib.suppress(OSError), open(f"/proc/sys/fs/mqueue/{key}") as f:
            got.append(f"{key} {f.read().strip()}")
    return ", ".join(got) or "not readable"


# ----------------------------------------------------------------------- output


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# POSIX shared memory: posix_ipc against shmloader's own files",
        "",
        *provenance.header(result["provenance"]),
        "",
        f"posix_ipc {result['posix_ipc']}, {result['glibc']}; each operation timed "
        f"alone, the ways taking turns; {result['n']} times each (touch: fewer at large "
        f"sizes, column n); {result['cores']} cores, load average {result['loadavg'][0]:.2f} "
        f"at the start and {result['loadavg'][1]:.2f} at the end: on a shared machine the "
        "p50 is the figure to read, the p90 and the mean carry the neighbours.",
        "",
        "| operation | MiB | way | p50 us | p90 us | mean us | n |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['op']} | {r['mib']:g} | {r['way']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} "
            f"| {r['mean_us']:.1f} | {r['n']} |"
        )
    lines += ["", "Ways:", ""] + [f"- `{k}`: {v}" for k, v in WAYS.items()]
    lines += ["", "Operations:", ""] + [f"- `{k}`: {v}" for k, v in OPS.items()]
    lines += [
        "",
        f"## Facts, each tested ({result['facts']['namespace']})",
        "",
        "| question | posix_ipc | shmloader |",
        "| --- | --- | --- |",
    ]
    for f in result["facts"]["facts"]:
        cells = [f[k].replace("|", "/") for k in ("question", "posix_ipc", "shmloader")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Signalling",
        "",
        f"A round trip: this process wakes a fresh peer process, which wakes this one "
        f"({result['trips']} measured after 50); a lock: uncontended lock + unlock, "
        f"{result['n']} times.",
        "",
        "| job | way | p50 us | p90 us | mean us | n |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["signalling"]:
        lines.append(
            f"| {r['job']} | {r['way']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} "
            f"| {r['mean_us']:.1f} | {r['n']} |"
        )
    held = result["killed_holder"]
    lines += [
        "",
        "The lock comes free when its holder is SIGKILLed: "
        f"`fcntl.lockf` {held['fcntl.lockf']}; `posix_ipc.Semaphore` "
        f"{held['posix_ipc.Semaphore']}. POSIX message queues: {result['mqueue_limits']} "
        "(`/proc/sys/fs/mqueue`).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shm_open",
        description="posix_ipc against shmloader's own /dev/shm files: cost and guarantees.",
    )
    p.add_argument("--n", type=int, default=2000, help="times per operation and way")
    p.add_argument("--mib", type=float, nargs="+", default=[1.0, 64.0], help="segment sizes")
    p.add_argument("--trips", type=int, default=1000, help="wake-up round trips per way")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    args = p.parse_args(argv)
    if args.n < 1 or args.trips < 1 or min(args.mib) <= 0:
        p.error("--n and --trips must be >= 1 and every --mib > 0")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shml-shm-open-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pi = _posix_ipc()
    os.makedirs(args.out, exist_ok=True)
    print(f"benchmarks.shm_open: sizes {args.mib} MiB, n {args.n}; results go to {args.out}",
          file=sys.stderr)  # fmt: skip
    record = provenance.start("benchmarks.shm_open", argv)
    result: dict[str, Any] = {
        "command": record["command"],
        "provenance": record,
        "posix_ipc": pi.VERSION,
        "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "n": args.n,
        "trips": args.trips,
        "cores": os.cpu_count(),
        "loadavg": [os.getloadavg()[0]],
        "rows": [],
        "signalling": [],
    }
    for mib in args.mib:
        rows = measure_size(mib, args.n)
        result["rows"].extend(rows)
        for r in rows:
            print(f"{r['op']} {mib:g} MiB {r['way']}: p50 {r['p50_us']:.1f} us", file=sys.stderr)
    result["facts"] = facts()
    for kind, way in (("sem", "posix_ipc.Semaphore"), ("mq", "posix_ipc.MessageQueue"),
                      ("zmq", "zmq PAIR ipc://")):  # fmt: skip
        row = {"job": "wake-up round trip", "way": way, **_us(round_trips(kind, args.trips))}
        result["signalling"].append(row)
    for way, ns in lock_pairs(args.n).items():
        result["signalling"].append({"job": "lock + unlock", "way": way, **_us(ns)})
    for r in result["signalling"]:
        print(f"{r['job']} {r['way']}: p50 {r['p50_us']:.1f} us", file=sys.stderr)
    result["killed_holder"] = killed_holder()
    result["mqueue_limits"] = mqueue_limits()
    result["loadavg"].append(os.getloadavg()[0])
    provenance.finish(record)
    paths = [os.path.join(args.out, n) for n in ("shm_open.json", "shm_open.md")]
    with open(paths[0], "w") as fh:
        json.dump(result, fh, indent=1)
    with open(paths[1], "w") as fh:
        fh.write(markdown(result))
    for p in paths:
        print(f"wrote {os.path.abspath(p)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
