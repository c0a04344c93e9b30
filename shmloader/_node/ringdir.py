"""The ring directory: where a node's ring segments live, and what backs it.

``/dev/shm`` by default, ``SHMLOADER_SHM_DIR`` (``Config.shm_dir``) otherwise,
such as a tmpfs mounted with ``huge=within_size`` (docs/operating.md, "A
huge-page ring"). It only looks: ``check`` validates a directory for use,
``describe`` reports the filesystem holding it (type, ``huge=`` option, mode,
whether files there really get 2 MiB pages: NOTE [huge-page ring]), and it binds
the libc calls the mapping code needs. Which directory a process uses, and how
it maps there, is ``segment``'s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

#: The default ring directory.
DEFAULT = "/dev/shm"
#: The huge-page ring directory of the shipped systemd mount (systemd/mnt-shmloader.mount):
#: ``shmloader gc`` and ``stat`` look there too when it exists.
SYSTEMD_RING_DIR = "/mnt/shmloader"
# NOTE [huge-page ring]
#    A 256 MiB batch in 4 KiB tmpfs pages costs every reader 65536 page faults
#    to read it (31-33 ms) and as many page-table entries to unmap (10-11 ms),
#    every batch, on every rank. The same file on a tmpfs with
#    ``huge=within_size`` is 128 huge pages: touching it all takes about 1 ms
#    and unmapping 0.05 ms, for ``MAP_PRIVATE`` and ``MAP_SHARED`` mappings
#    alike. Three things must hold for that:
#
#    - the file gets huge pages at all: ``describe`` does not trust mount
#      options alone but writes a 2 MiB probe file (``O_TMPFILE``: it never
#      has a name) and reads its allocated blocks back. Without ``madvise``
#      first (``huge=always``/``within_size``, or ``shmem_enabled=force``),
#      else through a mapping advised ``MADV_HUGEPAGE`` (``huge=advise``,
#      ``shmem_enabled=advise`` where the kernel applies it to the mount);
#      ``advise`` then says every mapping must be advised too.
#    - slots are whole huge pages: header plus capacity a multiple of 2 MiB
#      (``ring.slot_capacity_for``), since ``huge=within_size`` gives a huge
#      page only where the file's size covers all of it.
#    - every mapping puts file offset 0 on a 2 MiB boundary of the address
#      space (``mapping._placeholder``): a payload mapped from offset
#      ``HEADER_SIZE`` sits at an address ``HEADER_SIZE`` past a boundary, so
#      the page tables map each file huge page with one entry. A mapping at
#      a 2 MiB-aligned address of an offset that is not (what a plain
#      anonymous placeholder gets) maps the same huge pages with 4 KiB
#      entries: 15 ms to touch 256 MiB instead of 1.5.
#    - a mapping covers each huge page it touches whole: the kernel maps a
#      huge page with one entry only where the mapping spans all of it. So
#      a batch's view (``Segment.map_view``, every rank's) starts at the
#      file's first byte, header page included, and ends on a huge page's
#      end: from offset ``HEADER_SIZE`` the first huge page (the header and
#      the payload's first 2 MiB - 4 KiB) took 4 KiB entries on every rank,
#      511 of them to fault in and to unmap per batch.
#
#    Checked per rank and per path (the leader's main process, a worker's
#    collate, a worker's copy) in ``/proc/self/smaps`` by
#    ``tests/multirank/test_hugepage.py``; ``python -m benchmarks.hugedir``
#    measures what touching a batch costs each of them.
#
#    Every rank of a group uses the same directory (an agreed setting of the
#    set-up marks: ``arrival.AGREED``), so readers open the writer's names and
#    the node probe (``topology``) is the ring directory's own.
HUGE = 2 << 20
#: ``statfs.f_type`` of a tmpfs, and of a hugetlbfs (which takes no ``write()``).
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"

_ACCEPTED = (
    "an existing directory (absolute path) that you can write, owned by you or root, and "
    "not writable by its group or other users unless it has the sticky bit (mode 1777, "
    "like /dev/shm)"
)


def check(path: object, name: str = "SHMLOADER_SHM_DIR") -> str:
    """``path`` if this process may keep its ring there, else :class:`ConfigError` naming ``name``.

    The directory must exist, be ours or root's, and be safe from other
    users: writable by its group or by others only with the sticky bit (else
    another user could remove or replace our segments). We must be able to create files
    in it.
    """
    if not isinstance(path, str) or not path or "\0" in path or not os.path.isabs(path):
        raise ConfigError(name, path, _ACCEPTED)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(name, path, f"{_ACCEPTED}; it cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(name, path, f"{_ACCEPTED}; it is not a directory")
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (me, 0):
        raise ConfigError(
            name,
            path,
            f"{_ACCEPTED}; it belongs to uid {st.st_uid}, who could remove our segments: "
            f"mount or make a directory of your own (mode 0700) or a shared one of root's "
            f"(mode 1777)",
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise ConfigError(
            name,
            path,
            f"{_ACCEPTED}; it has mode {mode:04o}: members of its group or other users could "
            f"remove or replace our segments (chmod 1777 {path}, or 0700 for your own)",
        )
    if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise ConfigError(name, path, f"{_ACCEPTED}; uid {me} cannot create files in it")
    if _fs_magic(path) == HUGETLBFS_MAGIC:
        raise ConfigError(
            name,
            path,
            f"{_ACCEPTED}; it is a hugetlbfs (a Kubernetes emptyDir of medium HugePages), "
            "which cannot hold segments (no write()): use a tmpfs mounted with huge=within_size",
        )
    return path


def from_env(environ: object = None) -> str:
    """The directory ``SHMLOADER_SHM_DIR`` names, unchecked (``DEFAULT`` when unset)."""
    env = os.environ if environ is None else environ
    raw = env.get("SHMLOADER_SHM_DIR", "")  # type: ignore[attr-defined]
    return raw if raw.strip() else DEFAULT


@dataclass(frozen=True)
class Facts:
    """What backs a ring directory (``stat``, the daemon's log and stats)."""

    path: str
    fs: str  # filesystem type from mountinfo ("tmpfs", "ext4", ...); "" when unknown
    mount: str  # the mount point holding it
    huge_option: str  # the mount's huge= option ("never" when absent)
    shmem_enabled: str  # the kernel's bracketed choice in shmem_enabled ("" if absent)
    mode: str  # e.g. "1777"
    owner: int
    huge: bool  # files there get 2 MiB pages (probed)
    advise: bool  # only through mappings advised MADV_HUGEPAGE
    why: str  # one line saying how (or why not)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def describe(path: str) -> Facts:
    """The facts of ``path`` (cached per directory and filesystem; see NOTE [huge-page ring])."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return Facts(path, "", "", "", _shmem_enabled(), "", -1, False, False, exc.strerror or "")
    return _describe(os.path.realpath(path), st.st_dev, st.st_ino, path)


@functools.lru_cache(maxsize=16)
def _describe(real: str, dev: int, ino: int, path: str) -> Facts:
    st = os.stat(real)
    fs, mount, options = _mount_of(real)
    huge_option = next((o[5:] for o in options if o.startswith("huge=")), "never")
    shmem = _shmem_enabled()
    base: dict[str, Any] = dict(
        path=path,
        fs=fs,
        mount=mount,
        huge_option=huge_option,
        shmem_enabled=shmem,
        mode=f"{stat.S_IMODE(st.st_mode):04o}",
        owner=st.st_uid,
    )
    if _fs_magic(real) != TMPFS_MAGIC:
        why = f"not a tmpfs ({fs or 'unknown filesystem'}): 4 KiB pages"
        return Facts(**base, huge=False, advise=False, why=why)
    if _probe(real, advise=False):
        how = "shmem_enabled=force" if shmem == "force" else f"huge={huge_option}"
        return Facts(**base, huge=True, advise=False, why=f"tmpfs, {how}: 2 MiB pages")
    if _probe(real, advise=True):
        how = f"huge={huge_option}" if huge_option == "advise" else f"shmem_enabled={shmem}"
        why = f"tmpfs, {how}: 2 MiB pages through MADV_HUGEPAGE"
        return Facts(**base, huge=True, advise=True, why=why)
    if huge_option in ("always", "within_size", "advise"):
        why = (
            f"tmpfs, huge={huge_option}, but a 2 MiB probe got 4 KiB pages (no free huge page, "
            "or shmem_enabled=deny)"
        )
    else:
        why = (
            f"tmpfs without huge= (shmem_enabled={shmem or 'absent'}): 4 KiB pages; mount a "
            "tmpfs with huge=within_size for a huge-page ring"
        )
    return Facts(**base, huge=False, advise=False, why=why)


def _mount_of(path: str) -> tuple[str, str, list[str]]:
    """(fs type, mount point, super options) of the mount holding ``path``."""
    best: tuple[str, str, list[str]] = ("", "", [])
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[1]):  # a later mount over the same point wins
            best = (tail[0], point, tail[2].split(","))
    return best


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape")


def _shmem_enabled() -> str:
    try:
        with open(_SHMEM_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def _fs_magic(path: str) -> int:
    """``statfs(path).f_type`` (0 when it cannot be read)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    try:
        if LIBC.statfs(os.fsencode(path), buf) != 0:
            return 0
    except (AttributeError, OSError):
        return 0
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def _probe(path: str, *, advise: bool) -> bool:
    """Whether a 2 MiB file in ``path`` gets a huge page (its blocks say so).

    ``O_TMPFILE``: the probe never has a name, so nothing can be left behind.
    ``advise``: the page is faulted in through a mapping advised
    ``MADV_HUGEPAGE`` (placed at a 2 MiB boundary by the kernel); otherwise a
    one-byte write allocates it.
    """
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(fd, HUGE)
        if not advise:
            os.pwrite(fd, b"\0", 0)
        else:
            addr = LIBC.mmap(None, HUGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return False
            try:
                if LIBC.madvise(ctypes.c_void_p(addr), HUGE, MADV_HUGEPAGE) != 0:
                    return False
                ctypes.memset(addr, 0, 1)
            finally:
                LIBC.munmap(ctypes.c_void_p(addr), HUGE)
        return os.fstat(fd).st_blocks * 512 >= HUGE
    except OSError:
        return False
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    return libc


#: libc with ``mmap``, ``munmap``, ``madvise`` and ``statfs`` prototyped, resolved at import
#: (a forked child must not ``dlopen``/``dlsym``); ``segment`` maps through it too.
LIBC = _libc()
