"""One POSIX shared-memory segment with a validated header, in this process's ring directory.

It owns the segment header (layout: docs/internals/wire.md), segment names
(``/shml-<token>-<what>.<random>``: NOTE [unpredictable names]), the exclusive
create and ``posix_fallocate``, checked opens and validated attach (NOTE
[segment trust]), every mapping of a segment (shared, read-only and private
views, none keeping a descriptor: NOTE [no inherited descriptors]; how a mapping
is made without one and how its pages are faulted in is ``mapping``'s, what a
forked child gets of them ``forks``'), and process liveness. It touches only
files under the ring directory and imports only ``cleanup``, ``forks``,
``mapping``, ``ringdir`` and ``errors``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError, ProtocolError, ShmCapacityError
from . import cleanup, forks, ringdir
from .mapping import map_fd

MAGIC = b"SHMLDR\x00\x01"
HEADER_VERSION = 2
PREFIX = "shml-"
#: This process's ring directory (NOTE [huge-page ring] in ``ringdir``):
#: ``SHMLOADER_SHM_DIR`` or ``/dev/shm``; a ShmLoader sets its ``Config.shm_dir``
#: (``use_dir``), a spawned DataLoader worker its pool's (``pool.PoolSpec``).
SHM_DIR = ringdir.from_env()

KIND_CONTROL = 1
KIND_DATA = 2
KIND_PROBE = 3
_KINDS = {KIND_CONTROL: "control", KIND_DATA: "data", KIND_PROBE: "probe"}

_HEADER = struct.Struct("<8sHHI16sQQQQ")
assert _HEADER.size == 64
_PIDNS = struct.Struct("<Qq")  # pid namespace, payload offset
_PIDNS_AT = 128
#: Bytes of a header read by ``validate`` (fixed fields up to the payload offset).
_HEADER_READ = _PIDNS_AT + _PIDNS.size
#: Attempts at a fresh random name before ``create_unique`` gives up.
NAME_TRIES = 16
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

PAGE = mmap.PAGESIZE
log = logging.getLogger(__name__)


# NOTE [header granule]
#    A mapping of a payload alone (``map_private``: a batch's view outside a
#    huge-page ring) starts at offset ``HEADER_SIZE``, and ``mmap`` takes only
#    offsets that are multiples of ``mmap.ALLOCATIONGRANULARITY``: 4 KiB on
#    x86, 64 KiB on aarch64 kernels built with 64 KiB pages (GH200 nodes); the
#    other mappings start at 0 and find the payload ``HEADER_SIZE`` in. So
#    the header is one granule long, at least 4 KiB, and the header records
#    the payload offset its creator used; ``validate`` refuses a segment whose
#    offset is not this process's (a build or kernel that lays segments out
#    differently) with a ``ProtocolError`` naming both, before anything is
#    mapped. Version 2 of the header added that field; versions 1 and 2 refuse
#    each other by version. ``SHMLOADER_HEADER_SIZE`` (a multiple of the
#    granule) sets another length, so that the 64 KiB layout is tested on x86
#    too, where a 64 KiB offset is just as valid.
def header_size(env: str | None = None) -> int:
    """The header length of this process's segments (NOTE [header granule]).

    One allocation granule, at least 4096 bytes; ``SHMLOADER_HEADER_SIZE``
    (``env`` here, for tests) sets a multiple of the granule instead.
    """
    granule = max(4096, mmap.ALLOCATIONGRANULARITY)
    raw = os.environ.get("SHMLOADER_HEADER_SIZE", "") if env is None else env
    if not raw.strip():
        return granule
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if size < granule or size % granule or size > 1 << 24:
        from ..errors import ConfigError

        raise ConfigError(
            "SHMLOADER_HEADER_SIZE",
            raw,
            f"a multiple of this kernel's mmap granule ({granule} bytes) up to 16 MiB, "
            "or unset (one granule)",
        )
    return size


#: Bytes before the payload of every segment: the payload's mmap offset.
HEADER_SIZE = header_size()


@dataclass(frozen=True)
class Header:
    kind: int
    uid: int
    token: str
    pid: int
    start: int
    capacity: int
    created_ns: int
    pidns: int = 0
    payload_at: int = HEADER_SIZE

    @property
    def kind_name(self) -> str:
        return _KINDS.get(self.kind, f"kind{self.kind}")

    def pack(self) -> bytes:
        """The header's bytes up to and including ``payload_at`` (zero padded)."""
        fixed = _HEADER.pack(
            MAGIC,
            HEADER_VERSION,
            self.kind,
            self.uid,
            self.token.encode().ljust(16, b"\0"),
            self.pid,
            self.start,
            self.capacity,
            self.created_ns,
        )
        return fixed.ljust(_PIDNS_AT, b"\0") + _PIDNS.pack(self.pidns, self.payload_at)

    def write(self, fd: int) -> None:
        """Rewrite this header in place, leaving the bytes between its fields alone.

        A control segment keeps the ring's counters right after the fixed
        fields (``ring._COUNTERS_AT``): ``pack()``'s zero padding would wipe them.
        """
        fixed = self.pack()
        os.pwrite(fd, fixed[: _HEADER.size], 0)
        os.pwrite(fd, fixed[_PIDNS_AT:], _PIDNS_AT)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        """Parse a header; :class:`ProtocolError` unless it is one of ours."""
        if len(raw) < _HEADER.size:
            raise ProtocolError(f"segment too short for a header ({len(raw)} bytes)")
        magic, version, kind, uid, token, pid, start, capacity, created = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: not a shmloader segment")
        if version != HEADER_VERSION:
            raise ProtocolError(
                f"segment header version {version}; this build reads version {HEADER_VERSION} "
                "only: another shmloader version made it. Run one shmloader version per node "
                "(`shmloader gc` removes stale segments)"
            )
        if kind not in _KINDS:
            raise ProtocolError(f"unknown segment kind {kind}")
        try:
            token_text = token.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("segment token is not ASCII") from None
        if len(raw) < _HEADER_READ:
            raise ProtocolError(f"segment too short for a header ({len(raw)} bytes)")
        pidns, payload_at = _PIDNS.unpack_from(raw, _PIDNS_AT)
        return cls(kind, uid, token_text, pid, start, capacity, created, pidns, payload_at)


# ------------------------------------------------------------- process identity


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":  # a zombie is dead for our purposes
        return None
    return int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    """True when ``pid`` runs and is the same process that started at ``start``."""
    if pid <= 0:
        return False
    now = proc_start_time(pid)
    return now is not None and (start == 0 or now == start)


def pid_namespace(pid: int | str = "self") -> int:
    """Inode of the pid namespace of ``pid`` (0 when it cannot be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


MY_START = proc_start_time(os.getpid()) or 0
MY_PIDNS = pid_namespace()


def owner_alive(header: Header) -> bool:
    """Whether the owner named by ``header`` may still run (NOTE [segment trust]).

    An owner in another pid namespace than ours cannot be judged by its pid:
    it counts as alive, so nothing of it is ever reaped by a pid test.
    """
    if header.pidns and MY_PIDNS and header.pidns != MY_PIDNS:
        return True
    return process_alive(header.pid, header.start)


def _refresh_identity() -> None:
    """Re-read our start time and pid namespace after a fork (os.register_at_fork)."""
    global MY_START, MY_PIDNS
    MY_START = proc_start_time(os.getpid()) or 0
    MY_PIDNS = pid_namespace()


os.register_at_fork(after_in_child=_refresh_identity)


# ------------------------------------------------------------------- segments


_HERE = threading.local()


def ring_dir() -> str:
    """The directory names are resolved in: this thread's ``in_dir``, else ``SHM_DIR``."""
    return getattr(_HERE, "dir", None) or SHM_DIR


@contextlib.contextmanager
def in_dir(directory: str) -> Iterator[str]:
    """Resolve names in ``directory`` on this thread for a while (``stat``/``gc`` scans)."""
    before = getattr(_HERE, "dir", None)
    _HERE.dir = directory
    try:
        yield directory
    finally:
        _HERE.dir = before


def use_dir(directory: str) -> None:
    """Make ``directory`` this process's ring directory (a ShmLoader's ``Config.shm_dir``).

    One directory per process: while segments made here are still named in
    another one, a change is a :class:`ConfigError` (they would be unlinked
    in the wrong place).
    """
    global SHM_DIR
    if os.path.realpath(directory) == os.path.realpath(SHM_DIR):
        return
    made, _ = cleanup.owned()
    if made:
        raise ConfigError(
            "SHMLOADER_SHM_DIR",
            directory,
            f"the ring directory this process already uses ({SHM_DIR}, which holds "
            f"{len(made)} of its segments): one ring directory per process; close the other "
            "ShmLoader first or give both the same shm_dir",
        )
    SHM_DIR = directory


def huge_ring(directory: str | None = None) -> bool:
    """Whether segments in ``directory`` (the ring directory) get 2 MiB pages."""
    return ringdir.describe(directory or ring_dir()).huge


def shm_path(name: str) -> str:
    return os.path.join(ring_dir(), name.lstrip("/"))


def shm_free_bytes() -> int | None:
    """Bytes still available in the ring directory (None when it cannot be read)."""
    st = _shm_statvfs()
    return None if st is None else st.f_bavail * st.f_frsize


def shm_size_bytes() -> int | None:
    """Total size of the ring directory's filesystem (None when it cannot be read)."""
    st = _shm_statvfs()
    return None if st is None else st.f_blocks * st.f_frsize


def _shm_statvfs() -> os.statvfs_result | None:
    try:
        return os.statvfs(ring_dir())
    except OSError:
        return None


class _Droppable(Protocol):
    def drop(self) -> None: ...


class Segment:
    """A POSIX shm segment we created (``create``) or validated (``attach``).

    Holds the file descriptor; mappings are made on demand. ``unlink`` removes
    the name (mappings and descriptors stay valid), ``close`` the descriptor.
    """

    def __init__(self, name: str, fd: int, header: Header) -> None:
        self.name = name
        self.fd = fd
        self.header = header
        self.linked = True
        self.owner = os.getpid()  # NOTE [creator-only cleanup]
        self.directory = ring_dir()
        self.pages = ringdir.describe(self.directory)  # NOTE [huge-page ring]
        #: the slot's standing mapping, dropped by ``close`` (NOTE [a standing mapping])
        self.standing: _Droppable | None = None
        _OPEN.add(self)  # closed in a forked child: NOTE [no inherited descriptors]

    @property
    def capacity(self) -> int:
        return self.header.capacity

    @classmethod
    def create(cls, name: str, kind: int, token: str, capacity: int) -> Segment:
        """Create ``name`` exclusively, reserve its pages and write the header.

        The pages are reserved with ``posix_fallocate``: a full ``/dev/shm``
        fails here with :class:`ShmCapacityError`, never later with SIGBUS.
        Anything already at ``name`` is left alone and is a
        :class:`ProtocolError`; ``create_unique`` is the way to get a name
        nobody can squat (NOTE [unpredictable names]).
        """
        fd = _create_exclusive(name)
        if fd is None:
            raise ProtocolError(
                f"shared memory segment {name} already exists; refusing to reuse it "
                "(`shmloader gc --dry-run` lists stale segments)"
            )
        return cls._initialise(name, fd, kind, token, capacity)

    # NOTE [unpredictable names]
    #     The ring token is visible to every local user in ``/dev/shm``, so a name
    #     derived from it alone could be planted in advance (a FIFO there hangs an
    #     ``open``, a file there fails a create). Every segment name therefore ends
    #     in its own random part (64 bits from ``secrets``) that travels only in
    #     our messages (BATCH carries ``seg``; the set-up exchange carries the probe
    #     name). ``Segment.create_unique`` creates with ``O_CREAT | O_EXCL |
    #     O_NOFOLLOW``; an object already at the name (planted, or a 2^-64
    #     collision) means another random name, never a failure. Every open is
    #     ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO or a device cannot block us) and is
    #     ``fstat``-checked to be a regular file of our uid with mode 0600 before
    #     a byte is read or mapped.
    @classmethod
    def create_unique(cls, stem: str, kind: int, token: str, capacity: int) -> Segment:
        """Create ``<stem>.<random>`` exclusively (NOTE [unpredictable names]).

        An object already at a drawn name (planted by someone, or a collision)
        means another draw, never a failure, up to ``NAME_TRIES`` draws.
        """
        for _ in range(NAME_TRIES):
            name = f"{stem}.{secrets.token_hex(8)}"
            fd = _create_exclusive(name)
            if fd is not None:
                return cls._initialise(name, fd, kind, token, capacity)
            log.warning("shmloader: %s is taken by something we did not make; drew again", name)
        raise ProtocolError(
            f"{NAME_TRIES} random names {stem}.* in {ring_dir()} were all taken: someone is "
            f"filling {ring_dir()}; check its contents (`ls -la {ring_dir()}`)"
        )

    @classmethod
    def _initialise(cls, name: str, fd: int, kind: int, token: str, capacity: int) -> Segment:
        capacity = _round_up(max(capacity, PAGE), PAGE)
        total = HEADER_SIZE + capacity
        try:
            os.fchmod(fd, 0o600)  # the umask may not narrow it, but be explicit
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmCapacityError(total, shm_free_bytes(), f"creating {name}") from None
                raise
            header = Header(
                kind,
                os.geteuid(),
                token,
                os.getpid(),
                MY_START,
                capacity,
                time.time_ns(),
                MY_PIDNS,
            )
            os.pwrite(fd, header.pack(), 0)
        except BaseException:
            os.close(fd)
            _unlink_quietly(name)
            raise
        cleanup.own(segment=name)  # removed on SIGTERM (NOTE [SIGTERM] in cleanup)
        return cls(name, fd, header)

    @classmethod
    def attach(cls, name: str, *, kind: int, token: str | None) -> Segment:
        """Open ``name`` and validate it (NOTE [segment trust])."""
        try:
            fd = open_checked(name, writable=True)
        except FileNotFoundError:
            raise ProtocolError(f"shared memory segment {name} does not exist") from None
        try:
            header = validate(fd, name, kind=kind, token=token)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, header)

    def map_shared(self, *, inherit: bool = False) -> mmap.mmap:
        """The whole segment, MAP_SHARED: the writer's view.

        Not inherited by a forked child unless ``inherit`` (NOTE [creator-only
        cleanup]).
        """
        if inherit:
            return map_fd(self.fd, HEADER_SIZE + self.capacity, mmap.MAP_SHARED, pages=self.pages)
        with forks.no_fork():  # never a child between the mapping and its advice
            mm = map_fd(self.fd, HEADER_SIZE + self.capacity, mmap.MAP_SHARED, pages=self.pages)
            forks.dont_fork(mm)
        return mm

    def map_private(self, nbytes: int) -> mmap.mmap:
        """The first ``nbytes`` of payload, copy-on-write (MAP_PRIVATE).

        Writes through it stay in this process. A page written here keeps its
        private copy even after the writer rewrites the slot, so such a mapping
        must never outlive the batch it was made for (NOTE [slot lifetime]).
        A forked child gets its own copy of it (NOTE [batches cross a fork]).
        """
        return self._map_private(nbytes, HEADER_SIZE)

    def map_view(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """A batch's view: ``map_private`` of ``nbytes``, and the payload's offset in it.

        In a huge-page ring the mapping starts at the file's first byte, its
        header page included (payload at ``HEADER_SIZE``), so that the file's
        first 2 MiB page is mapped whole, like every other one (NOTE
        [huge-page ring] in ``ringdir``); elsewhere the payload is at 0.
        """
        start = 0 if self.pages.huge else HEADER_SIZE
        return self._map_private(nbytes, start), HEADER_SIZE - start

    def _map_private(self, nbytes: int, start: int) -> mmap.mmap:
        """MAP_PRIVATE from file offset ``start`` to past the first ``nbytes`` of payload."""
        if nbytes > self.capacity:
            raise ProtocolError(f"{nbytes} bytes asked of {self.name}, which holds {self.capacity}")
        end = HEADER_SIZE + _round_up(max(nbytes, 1), PAGE)
        if self.pages.huge:  # to the end of a huge page: one page-table entry for the tail too
            end = min(HEADER_SIZE + self.capacity, _round_up(end, ringdir.HUGE))
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        with forks.no_fork():  # a child gets the view registered: NOTE [batches cross a fork]
            mm = map_fd(self.fd, end - start, mmap.MAP_PRIVATE, prot, start, pages=self.pages)
            forks.copy_at_fork(mm)
        forks.let_go()  # views held for children that are gone since
        return mm

    def map_standing(self) -> mmap.mmap:
        """The whole payload, copy-on-write, never inherited by a forked child.

        A slot's standing mapping (NOTE [a standing mapping] in ``standing``):
        its batches are views of it in turn. Call inside ``forks.no_fork``.
        """
        if self.fd < 0:
            raise ProtocolError(f"segment {self.name} is closed; its slot was retired")
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mm = map_fd(self.fd, self.capacity, mmap.MAP_PRIVATE, prot, HEADER_SIZE, pages=self.pages)
        forks.dont_fork(mm)
        return mm

    def map_readonly(self) -> mmap.mmap:
        """The whole segment, read-only and MAP_SHARED: what a CUDA consumer registers.

        Not inherited by a forked child (NOTE [creator-only cleanup]).
        """
        if self.fd < 0:
            raise ProtocolError(f"segment {self.name} is closed; its slot was retired")
        size = HEADER_SIZE + self.capacity
        with forks.no_fork():  # never a child between the mapping and its advice
            mm = map_fd(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ, pages=self.pages)
            forks.dont_fork(mm)
        return mm

    def unlink(self) -> None:
        """Remove the name; a no-op outside the process that made this object."""
        if self.linked and self.owner == os.getpid():
            self.linked = False
            with in_dir(self.directory):
                _unlink_quietly(self.name)
            cleanup.disown(segment=self.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.standing is not None:
            self.standing.drop()
            self.standing = None

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.header.kind_name}, {self.capacity} bytes)"


# NOTE [no inherited descriptors]
#     A forked child (a DataLoader worker made after the ring started, an eval
#     loader's persistent workers) inherits every descriptor of its parent;
#     a descriptor of a segment keeps the segment's memory alive after the
#     parent retired and unlinked it, for as long as the child lives. Two
#     kinds are held: each ``Segment``'s own descriptor, and the duplicate
#     that Python's ``mmap.mmap`` keeps of the descriptor it maps. So every
#     ``Segment`` closes its descriptor in a forked child (``os.register_at_fork``:
#     a child opens what it needs by name, as ``ring.open_slot_for_worker``
#     does), so does any other descriptor of a ``/dev/shm/shml-*`` file there
#     (one left open by an object dropped unclosed), and every mapping of a
#     segment gives up its duplicate at once (``mapping.map_fd``: the ``mmap``
#     object is made anonymous, without a descriptor, and libc's ``mmap`` puts
#     the segment's pages over it at the same address).
#: Every ``Segment`` of this process whose descriptor may be open.
_OPEN: weakref.WeakSet[Segment] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a forked child: close every inherited segment descriptor.

    NOTE [no inherited descriptors].
    """
    for seg in list(_OPEN):
        if seg.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(seg.fd)
            seg.fd = -1
    _OPEN.clear()
    # Descriptors no object holds any more (a Segment dropped unclosed, a
    # writer dropped without close) would pin their segments just the same.
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    shm = os.path.join(SHM_DIR, PREFIX)  # the process's ring directory
    for name in fds:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(shm):
                os.close(int(name))
        except (OSError, ValueError):
            continue


os.register_at_fork(after_in_child=_close_inherited)


#: ``validate(..., owner=ANY_UID)``: a segment of any uid (root's node-wide scan).
ANY_UID = -1


# NOTE [segment trust]
#     A segment is only ever read after ``attach`` validated its header against
#     what the reader expects (kind, token) and checked that it belongs to our
#     own uid and is mode 0600. Segments are created with ``O_EXCL``: a stale
#     segment with the same name is an error, never silently reused. Liveness of
#     an owner is (pid, start time): a recycled pid has a different start time.
#     The header records the owner's pid namespace: an owner in another pid
#     namespace (containers that share ``/dev/shm`` but not pids) cannot be
#     judged by its pid, so ``owner_alive`` calls it alive (never reaped by pid).
def validate(
    fd: int, name: str, *, kind: int | None, token: str | None, owner: int | None = None
) -> Header:
    """Check owner, mode, size and header of an open segment (NOTE [segment trust]).

    ``owner`` is the uid the file must belong to: ours by default. ``ANY_UID``
    accepts any uid whose header names the file's own owner: only the node
    scan of root (``shmloader gc`` as root, ``shmloaderd`` in node mode) asks
    for it, and nothing it accepts is ever mapped (NOTE [reaping rule] in
    ``shmloader._node.reaping``).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(f"{name} is not a regular file (mode {st.st_mode:o}); not ours")
    expected = os.geteuid() if owner is None else owner
    if expected != ANY_UID and st.st_uid != expected:
        raise ProtocolError(f"{name} belongs to uid {st.st_uid}, not to us ({expected})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ProtocolError(f"{name} has mode {stat.S_IMODE(st.st_mode):o}; expected 0600")
    header = Header.unpack(os.pread(fd, _HEADER_READ, 0))
    if kind is not None and header.kind != kind:
        raise ProtocolError(f"{name} is a {header.kind_name} segment, expected {_KINDS[kind]}")
    if token is not None and header.token != token:
        raise ProtocolError(f"{name} carries job token {header.token!r}, expected {token!r}")
    if header.payload_at != HEADER_SIZE:
        raise ProtocolError(
            f"{name} has its payload at byte {header.payload_at}; this process maps payloads at "
            f"{HEADER_SIZE} (NOTE [header granule]): its maker ran with another page granule or "
            "SHMLOADER_HEADER_SIZE; give every process of the node the same setting"
        )
    if header.uid != st.st_uid:
        raise ProtocolError(f"{name} header names uid {header.uid} but the file is {st.st_uid}'s")
    if st.st_size < HEADER_SIZE + header.capacity:
        raise ProtocolError(
            f"{name} is {st.st_size} bytes; its header promises {HEADER_SIZE + header.capacity}"
        )
    return header


def open_checked(name: str, *, writable: bool = False) -> int:
    """Open ``name`` without following links or blocking, and check it is a regular file.

    ``O_NOFOLLOW | O_NONBLOCK``: a symlink fails, a planted FIFO or device
    cannot block the open; anything but a regular file is refused before a
    byte is read (NOTE [unpredictable names]). Owner and mode are checked by
    ``validate``. ``FileNotFoundError`` when nothing is there.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS
    try:
        fd = os.open(shm_path(name), flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ProtocolError(f"cannot open {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{name} is not a regular file (mode {st.st_mode:o}); not ours")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_exclusive(name: str) -> int | None:
    """A new 0600 file at ``name``, or None when anything is there already."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS
    try:
        return os.open(shm_path(name), flags, 0o600)
    except FileExistsError:
        return None


def read_header(name: str) -> Header:
    """Header of a segment by name without keeping it open (for stat and gc)."""
    fd = open_checked(name)
    try:
        return validate(fd, name, kind=None, token=None)
    finally:
        os.close(fd)


def list_segments() -> list[str]:
    """Names (``/shml-...``) of what in the ring directory looks like ours (not yet validated)."""
    try:
        return sorted("/" + n for n in os.listdir(ring_dir()) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


# NOTE [creator-only cleanup]
#     A forked child (a DataLoader worker) inherits every object of its parent,
#     finalizers included: at its interpreter exit they would unlink the
#     parent's names. Every cleanup records the pid that created the resource
#     (``Segment.owner``, ``Hub``, the ring's finalizer) and is a no-op in any
#     other process. The writer's shared and read-only mappings of slots are
#     ``MADV_DONTFORK`` (``forks.dont_fork``): a child neither pins a retired slot nor inherits a
#     writable view of one; a worker that must write a slot opens it by name
#     itself (``ring.open_slot_for_worker``). A batch's private views are
#     inherited and made the child's own at once (NOTE [batches cross a fork]
#     in ``forks``).


def unlink_name(name: str) -> bool:
    """Remove a segment name; False when it was already gone."""
    try:
        os.unlink(shm_path(name))
        return True
    except FileNotFoundError:
        return False


def _unlink_quietly(name: str) -> None:
    unlink_name(name)


def remove_own_segments(segments: set[str], tokens: set[str]) -> None:
    """What SIGTERM removes of ours (NOTE [SIGTERM] in ``cleanup``).

    Of ``segments``, those whose header names this process; of the rings
    ``tokens``, every segment whose header names it (a forked worker's).
    """
    with contextlib.suppress(Exception):
        segments = {n for n in segments if _names_us(n)}  # not what we handed over
        if tokens:
            segments |= _made_for_us(tokens)
    for name in segments:
        with contextlib.suppress(OSError):
            unlink_name(name)


def _names_us(name: str) -> bool:
    """Whether the segment ``name`` is there and its header names this process as owner."""
    try:
        header = read_header(name)
    except (OSError, ProtocolError):
        return False
    return header.pid == os.getpid() and header.start == MY_START


def _made_for_us(tokens: set[str]) -> set[str]:
    """Segments of rings ``tokens`` whose header names this process as owner (NOTE [SIGTERM])."""
    prefixes = tuple(f"/shml-{t}-" for t in tokens)
    return {name for name in list_segments() if name.startswith(prefixes) and _names_us(name)}


cleanup.removes_segments(remove_own_segments)  # the registry sits below us (NOTE [layers])


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
