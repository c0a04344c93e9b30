"""Private runtime directories: where a writer's ZeroMQ sockets live, and who owns each.

Owns the directory's name, mode and life (make, check, list for reaping, remove:
NOTE [private runtime directory]); may touch the runtime base directory and the
cleanup registry. No torch, no ZeroMQ.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile

from ..errors import ConfigError, ProtocolError
from . import cleanup, segment
from .segment import process_alive

#: Prefix of private runtime directories (NOTE [private runtime directory]).
RUNDIR_PREFIX = "shml-"
#: File name of the writer's socket inside its private directory.
SOCKET_NAME = "s"
#: File name of the writer's announcement socket beside it (NOTE [one announcement]).
ANNOUNCE_NAME = "p"
#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def runtime_base(parent: str | None) -> str:
    """The directory private runtime directories are made in."""
    return (
        parent
        or os.environ.get("SHMLOADER_RUNTIME_DIR")
        or os.environ.get("XDG_RUNTIME_DIR")
        or "/tmp"
    )


def rundir_prefix(pid: int, start: int, pidns: int) -> str:
    """``shml-<pid>.<start>.<pidns>-`` in hex: the owner, for reaping; short for sun_path."""
    return f"{RUNDIR_PREFIX}{pid:x}.{start:x}.{pidns:x}-"


#: ``shml-<pid>.<start>.<pidns>-<random>``, hex (NOTE [private runtime directory]).
RUNDIR_NAME = re.compile(
    r"^shml-(?P<pid>[0-9a-f]{1,8})\.(?P<start>[0-9a-f]{1,16})\.(?P<pidns>[0-9a-f]{1,16})-"
    r"[A-Za-z0-9_]{1,32}$"
)


def private_dirs(
    parent: str | None = None, *, every_uid: bool = False
) -> list[tuple[str, int, bool]]:
    """Our private runtime directories under the base: (path, owner pid, owner alive).

    Only real directories of our uid (of any uid with ``every_uid``: root's
    node-wide reaping) with mode 0700 whose name matches ``RUNDIR_NAME``
    count. An owner in another pid namespace counts as alive.
    """
    base = runtime_base(parent)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        m = RUNDIR_NAME.match(name)
        if m is None:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (
            not stat.S_ISDIR(st.st_mode)
            or (st.st_uid != os.geteuid() and not every_uid)
            or stat.S_IMODE(st.st_mode) & 0o077
        ):
            continue
        pid, start, pidns = int(m["pid"], 16), int(m["start"], 16), int(m["pidns"], 16)
        foreign = bool(pidns and segment.MY_PIDNS and pidns != segment.MY_PIDNS)
        out.append((path, pid, foreign or process_alive(pid, start)))
    return out


# NOTE [private runtime directory]
#     Every rank makes its own directory with ``mkdtemp`` under the runtime base
#     (``$SHMLOADER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR``, else ``/tmp``)
#     before the set-up exchange, and the exchange carries its path
#     (``RankFacts.rundir``); the ranks that do not become a writer remove
#     theirs at once. ``mkdtemp`` creates a new directory of a random name with
#     mode 0700 (``O_EXCL`` semantics), so nobody can squat it in advance (a
#     fixed ``shmloader-<uid>`` under ``/tmp`` could be) and no other user can
#     connect to its socket. A reader checks the directory it was given is a
#     real directory of our uid with mode 0700 before it connects. The name is
#     ``shml-<pid>.<start>.<pidns>-<random>`` (hex): the owner for reaping
#     (``private_dirs``; a directory of another pid namespace is never judged by pid),
#     short enough that the socket path fits ``sun_path`` under long bases.
#     Sockets and directories are removed only by the process that made them
#     (NOTE [creator-only cleanup] in ``segment``).
def make_private_dir(parent: str | None) -> str:
    """A new 0700 directory of a random name for this process (NOTE [private runtime directory])."""
    base = runtime_base(parent)
    prefix = rundir_prefix(os.getpid(), segment.MY_START, segment.MY_PIDNS)
    try:
        path = tempfile.mkdtemp(prefix=prefix, dir=base)
    except OSError as exc:
        raise ConfigError("SHMLOADER_RUNTIME_DIR", base, f"a writable directory ({exc})") from None
    cleanup.own(directory=path)  # removed on SIGTERM (NOTE [SIGTERM] in cleanup)
    sock = os.path.join(path, SOCKET_NAME)
    if len(sock.encode()) > MAX_SOCKET_PATH:
        remove_private_dir(path, os.getpid())
        raise ConfigError(
            "SHMLOADER_RUNTIME_DIR",
            base,
            f"a shorter directory: the socket path {sock} is {len(sock.encode())} bytes and "
            f"ipc sockets take at most {MAX_SOCKET_PATH}",
        )
    return path


def check_private_dir(path: str) -> None:
    """:class:`ProtocolError` unless ``path`` is a real directory of ours with mode 0700.

    ``FileNotFoundError`` when nothing is there.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ProtocolError(f"runtime directory {path}: {exc.strerror}") from None
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) & 0o077
    ):
        raise ProtocolError(
            f"runtime directory {path} is not a directory of ours with mode 0700 (uid "
            f"{st.st_uid}, mode {st.st_mode:o}); refusing to use it"
        )


def remove_private_dir(path: str, creator: int) -> None:
    """Remove our socket and ``path`` itself, only in process ``creator``."""
    if os.getpid() != creator:
        return
    for name in (SOCKET_NAME, ANNOUNCE_NAME):
        with contextlib.suppress(OSError):
            sock = os.path.join(path, name)
            if stat.S_ISSOCK(os.lstat(sock).st_mode):
                os.unlink(sock)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    cleanup.disown(directory=path)


def socket_path(directory: str) -> str:
    """The writer's socket in its private directory."""
    return os.path.join(directory, SOCKET_NAME)


def announce_path(path: str) -> str:
    """The writer's announcement socket beside its socket ``path``."""
    return os.path.join(os.path.dirname(path), ANNOUNCE_NAME)
