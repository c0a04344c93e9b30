"""One POSIX shared-memory segment with a validated header.

Every segment shmloader creates starts with a fixed header page; the payload
starts at ``HEADER_SIZE`` so it can be mapped on its own, page aligned::

    offset  size  field
    0       8     magic     b"SHMLDR\\x00\\x01"
    8       2     version   HEADER_VERSION
    10      2     kind      1 control, 2 data, 3 probe
    12      4     uid       creator's effective uid
    16      16    token     per-ring random token (ASCII hex)
    32      8     pid       owner (creator) pid
    40      8     start     owner start time, clock ticks since boot
    48      8     capacity  payload bytes after the header page
    56      8     created   unix time in ns
    64      ...   kind-specific (control: counters and a JSON description)
    4096    capacity bytes of payload

Names are ``/shml-<token>-<suffix>``: the token is random per ring and job, so
nothing of an earlier or foreign job is ever opened by accident, and every
attach re-checks magic, version, token, kind and owner uid before a byte of
payload is mapped (NOTE [segment trust]).

NOTE [segment trust]
    A segment is only ever read after ``attach`` validated its header against
    what the reader expects (kind, token) and checked that it belongs to our
    own uid and is mode 0600. Segments are created with ``O_EXCL``: a stale
    segment with the same name is an error, never silently reused. Liveness of
    an owner is (pid, start time): a recycled pid has a different start time.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass

import posix_ipc

from .errors import ProtocolError, ShmCapacityError

MAGIC = b"SHMLDR\x00\x01"
HEADER_VERSION = 1
HEADER_SIZE = 4096
PREFIX = "shml-"
SHM_DIR = "/dev/shm"

KIND_CONTROL = 1
KIND_DATA = 2
KIND_PROBE = 3
_KINDS = {KIND_CONTROL: "control", KIND_DATA: "data", KIND_PROBE: "probe"}

_HEADER = struct.Struct("<8sHHI16sQQQQ")
assert _HEADER.size == 64

PAGE = mmap.PAGESIZE
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Header:
    kind: int
    uid: int
    token: str
    pid: int
    start: int
    capacity: int
    created_ns: int

    @property
    def kind_name(self) -> str:
        return _KINDS.get(self.kind, f"kind{self.kind}")

    def pack(self) -> bytes:
        return _HEADER.pack(
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

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        """Parse a header; :class:`ProtocolError` unless it is one of ours."""
        if len(raw) < _HEADER.size:
            raise ProtocolError(f"segment too short for a header ({len(raw)} bytes)")
        magic, version, kind, uid, token, pid, start, capacity, created = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: not a shmloader segment")
        if version != HEADER_VERSION:
            raise ProtocolError(f"header version {version}; this build reads {HEADER_VERSION}")
        if kind not in _KINDS:
            raise ProtocolError(f"unknown segment kind {kind}")
        try:
            token_text = token.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("segment token is not ASCII") from None
        return cls(kind, uid, token_text, pid, start, capacity, created)


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


MY_START = proc_start_time(os.getpid()) or 0


def _refresh_identity() -> None:
    """Re-read our start time after a fork (os.register_at_fork)."""
    global MY_START
    MY_START = proc_start_time(os.getpid()) or 0


os.register_at_fork(after_in_child=_refresh_identity)


# ------------------------------------------------------------------- segments


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def shm_free_bytes() -> int | None:
    """Bytes still available in ``/dev/shm`` (None when it cannot be read)."""
    st = _shm_statvfs()
    return None if st is None else st.f_bavail * st.f_frsize


def shm_size_bytes() -> int | None:
    """Total size of ``/dev/shm`` (None when it cannot be read)."""
    st = _shm_statvfs()
    return None if st is None else st.f_blocks * st.f_frsize


def _shm_statvfs() -> os.statvfs_result | None:
    try:
        return os.statvfs(SHM_DIR)
    except OSError:
        return None


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

    @property
    def capacity(self) -> int:
        return self.header.capacity

    @classmethod
    def create(cls, name: str, kind: int, token: str, capacity: int) -> Segment:
        """Create ``name`` exclusively, reserve its pages and write the header.

        The pages are reserved with ``posix_fallocate``: a full ``/dev/shm``
        fails here with :class:`ShmCapacityError`, never later with SIGBUS.
        """
        capacity = _round_up(max(capacity, PAGE), PAGE)
        total = HEADER_SIZE + capacity
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            if not _replace_stale(name):
                raise ProtocolError(
                    f"shared memory segment {name} already exists and belongs to a live process "
                    "or is not ours; refusing to reuse it (`shmloader gc --dry-run` lists stale)"
                ) from None
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        fd = shm.fd
        try:
            os.fchmod(fd, 0o600)  # the umask may not narrow it, but be explicit
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmCapacityError(total, shm_free_bytes(), f"creating {name}") from None
                raise
            header = Header(
                kind, os.geteuid(), token, os.getpid(), MY_START, capacity, time.time_ns()
            )
            os.pwrite(fd, header.pack(), 0)
        except BaseException:
            os.close(fd)
            _unlink_quietly(name)
            raise
        return cls(name, fd, header)

    @classmethod
    def attach(cls, name: str, *, kind: int, token: str | None) -> Segment:
        """Open ``name`` and validate it (NOTE [segment trust])."""
        try:
            shm = posix_ipc.SharedMemory(name, 0, read_only=False)
        except posix_ipc.ExistentialError:
            raise ProtocolError(f"shared memory segment {name} does not exist") from None
        fd = shm.fd
        try:
            header = validate(fd, name, kind=kind, token=token)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, header)

    def map_shared(self) -> mmap.mmap:
        """The whole segment, MAP_SHARED: the writer's view."""
        return mmap.mmap(self.fd, HEADER_SIZE + self.capacity, flags=mmap.MAP_SHARED)

    def map_private(self, nbytes: int) -> mmap.mmap:
        """The first ``nbytes`` of payload, copy-on-write (MAP_PRIVATE).

        Writes through it stay in this process. A page written here keeps its
        private copy even after the writer rewrites the slot, so such a mapping
        must never outlive the batch it was made for (NOTE [slot lifetime]).
        """
        if nbytes > self.capacity:
            raise ProtocolError(f"{nbytes} bytes asked of {self.name}, which holds {self.capacity}")
        length = _round_up(max(nbytes, 1), PAGE)
        return mmap.mmap(
            self.fd,
            length,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=HEADER_SIZE,
        )

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            _unlink_quietly(self.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.header.kind_name}, {self.capacity} bytes)"


def validate(fd: int, name: str, *, kind: int | None, token: str | None) -> Header:
    """Check owner, mode, size and header of an open segment (NOTE [segment trust])."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise ProtocolError(f"{name} belongs to uid {st.st_uid}, not to us ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ProtocolError(f"{name} has mode {stat.S_IMODE(st.st_mode):o}; expected 0600")
    header = Header.unpack(os.pread(fd, _HEADER.size, 0))
    if kind is not None and header.kind != kind:
        raise ProtocolError(f"{name} is a {header.kind_name} segment, expected {_KINDS[kind]}")
    if token is not None and header.token != token:
        raise ProtocolError(f"{name} carries job token {header.token!r}, expected {token!r}")
    if header.uid != st.st_uid:
        raise ProtocolError(f"{name} header names uid {header.uid} but the file is {st.st_uid}'s")
    if st.st_size < HEADER_SIZE + header.capacity:
        raise ProtocolError(
            f"{name} is {st.st_size} bytes; its header promises {HEADER_SIZE + header.capacity}"
        )
    return header


def _replace_stale(name: str) -> bool:
    """Unlink ``name`` if it is our uid's segment whose owner is dead; True if done.

    A segment left by a crashed earlier run under the same name is detected by
    its header and replaced, never reused. Anything that fails validation
    (another user's, corrupt) or whose owner still runs is left alone.
    """
    try:
        header = read_header(name)
    except (OSError, ProtocolError):
        return False
    if process_alive(header.pid, header.start):
        return False
    log.warning("shmloader: replacing stale segment %s of dead pid %d", name, header.pid)
    return unlink_name(name)


def read_header(name: str) -> Header:
    """Header of a segment by name without keeping it open (for stat and gc)."""
    fd = os.open(shm_path(name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return validate(fd, name, kind=None, token=None)
    finally:
        os.close(fd)


def list_segments() -> list[str]:
    """Names (``/shml-...``) of what in ``/dev/shm`` looks like ours (not yet validated)."""
    try:
        return sorted("/" + n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def touch(mm: mmap.mmap) -> None:
    """Fault every page of a fresh MAP_SHARED mapping in, once.

    Writing into fresh tmpfs pages costs about ten times a rewrite of touched
    ones; the ring pays it once at slot creation instead of on every batch.
    """
    try:
        mm.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14+)
        return
    except (OSError, ValueError):
        pass
    view = memoryview(mm)
    try:
        for off in range(0, len(mm), PAGE):
            view[off] = view[off]  # a write fault that keeps the header (and data) intact
    finally:
        view.release()


def unlink_name(name: str) -> bool:
    """Remove a segment name; False when it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def _unlink_quietly(name: str) -> None:
    unlink_name(name)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
