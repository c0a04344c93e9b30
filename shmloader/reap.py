"""Leave nothing behind: SIGTERM cleanup, and reaping our own dead leftovers.

Two mechanisms, both limited to what this uid made:

- ``own``/``disown`` keep a registry of the names this process created (shm
  segments, private runtime directories) and of the ring tokens it writes.
  A SIGTERM handler removes them before the process dies, so torchrun's
  stop signal leaves nothing in ``/dev/shm`` or the runtime directory
  (NOTE [SIGTERM]).
- ``reap_own`` runs when a loader starts: it removes our uid's segments and
  runtime directories whose owner is dead (NOTE [reaping rule] in ``admin``,
  the same rule ``shmloader gc`` applies). ``SHMLOADER_REAP=0`` switches it
  off (the test suite does, so that it never touches other runs' leftovers).

NOTE [SIGTERM]
    A process killed by SIGTERM with the default disposition runs no atexit
    handler and no finalizer. When the first name is registered (from the
    main thread) we look at the current disposition of SIGTERM:

    - ``SIG_DFL``: we install a handler that removes the registered names,
      restores ``SIG_DFL`` and sends SIGTERM to ourselves again: the process
      dies of the signal as it would have (exit status -15, 143 in a shell).
    - a Python handler of the application: we install a wrapper that calls it
      first. If it returns, the application chose to go on and nothing is
      removed (its normal exit runs our finalizers later); if it raises (for
      example ``SystemExit``), the names are removed and the exception goes on.
    - ``SIG_IGN`` or a handler installed outside Python: left alone.

    Segments made on our behalf by a forked child (a DataLoader worker that
    grows a pool slot writes our pid and start time into its header) are not
    in this process's list of names: for each registered ring token the
    handler also removes every ``/shml-<token>-*`` segment whose header names
    this very process (pid and start time) as its owner. Conversely, a name
    this process made but handed over (its header now names another owner:
    that worker's grown slot belongs to the leader, whose later workers open
    it by name) is left alone: a worker stopped by SIGTERM (the DataLoader's
    own shutdown does that to a worker slow to exit) must not unlink a slot
    of the live leader's ring. Only names whose header names us are removed.

    An application that installs its own handler later replaces ours; that is
    its right, and its normal exit path still runs our finalizers. In a forked
    child the registry is emptied (``os.register_at_fork``): a child never
    removes its parent's names (NOTE [creator-only cleanup] in ``segment``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_segments: set[str] = set()  # shm names created by this process and still linked
_dirs: set[str] = set()  # private runtime directories made by this process
_tokens: set[str] = set()  # rings this process writes: their segments may be a child's make
_installed = False


def own(
    *, segment: str | None = None, directory: str | None = None, token: str | None = None
) -> None:
    """Register a name this process created (or a ring it writes), to be removed on SIGTERM."""
    with _lock:
        if segment is not None:
            _segments.add(segment)
        if directory is not None:
            _dirs.add(directory)
        if token is not None:
            _tokens.add(token)
    _install()


def disown(
    *, segment: str | None = None, directory: str | None = None, token: str | None = None
) -> None:
    """Forget a name (it was removed, or handed over)."""
    with _lock:
        if segment is not None:
            _segments.discard(segment)
        if directory is not None:
            _dirs.discard(directory)
        if token is not None:
            _tokens.discard(token)


def owned() -> tuple[set[str], set[str]]:
    """(segments, directories) registered now (for tests and diagnostics)."""
    with _lock:
        return set(_segments), set(_dirs)


def remove_owned() -> None:
    """Remove every registered name now. Never raises."""
    from .segment import unlink_name

    with _lock:
        segments, dirs, tokens = set(_segments), set(_dirs), set(_tokens)
        _segments.clear()
        _dirs.clear()
        _tokens.clear()
    with contextlib.suppress(Exception):
        segments = {n for n in segments if _names_us(n)}  # not what we handed over
        if tokens:
            segments |= _made_for_us(tokens)
    for name in segments:
        with contextlib.suppress(OSError):
            unlink_name(name)
    for path in dirs:
        with contextlib.suppress(OSError):
            remove_runtime_dir(path)  # our sockets, then the directory


def _names_us(name: str) -> bool:
    """Whether the segment ``name`` is there and its header names this process as owner."""
    from .errors import ProtocolError
    from .segment import MY_START, read_header

    try:
        header = read_header(name)
    except (OSError, ProtocolError):
        return False
    return header.pid == os.getpid() and header.start == MY_START


def _made_for_us(tokens: set[str]) -> set[str]:
    """Segments of rings ``tokens`` whose header names this process as owner (NOTE [SIGTERM])."""
    from .segment import list_segments

    prefixes = tuple(f"/shml-{t}-" for t in tokens)
    return {name for name in list_segments() if name.startswith(prefixes) and _names_us(name)}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread
    _segments.clear()
    _dirs.clear()
    _tokens.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _install() -> None:
    """Install the SIGTERM handler once (NOTE [SIGTERM]); only from the main thread."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _die_by_default)
    elif callable(previous) and previous is not _die_by_default:
        signal.signal(signal.SIGTERM, _chained(previous))


def _die_by_default(signum: int, frame: Any) -> None:
    remove_owned()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _chained(previous: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        try:
            previous(signum, frame)
        except BaseException:
            remove_owned()
            raise

    handler.previous = previous  # type: ignore[attr-defined]
    return handler


# ------------------------------------------------------------------ reaping

#: ``shml-<pid>.<start>.<pidns>-<random>``, hex (NOTE [private runtime directory]).
RUNDIR_NAME = re.compile(
    r"^shml-(?P<pid>[0-9a-f]{1,8})\.(?P<start>[0-9a-f]{1,16})\.(?P<pidns>[0-9a-f]{1,16})-"
    r"[A-Za-z0-9_]{1,32}$"
)


def reaping_enabled() -> bool:
    return os.environ.get("SHMLOADER_REAP", "1").strip().lower() not in ("0", "false", "off")


def runtime_dirs(
    parent: str | None = None, *, every_uid: bool = False
) -> list[tuple[str, int, bool]]:
    """Our private runtime directories under the base: (path, owner pid, owner alive).

    Only real directories of our uid (of any uid with ``every_uid``: root's
    node-wide reaping) with mode 0700 whose name matches ``RUNDIR_NAME``
    count. An owner in another pid namespace counts as alive.
    """
    from .channel import runtime_base
    from .segment import MY_PIDNS, process_alive

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
        foreign = bool(pidns and MY_PIDNS and pidns != MY_PIDNS)
        out.append((path, pid, foreign or process_alive(pid, start)))
    return out


def remove_runtime_dir(path: str) -> bool:
    """Remove the sockets in a dead owner's directory, then the directory; True if gone.

    Anything but a socket inside is left alone, and then so is the directory.
    """
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return False
    for entry in entries:
        full = os.path.join(path, entry)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(full).st_mode):
                os.unlink(full)
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def reap_own(runtime_parent: str | None = None) -> int:
    """Opportunistic reaping when a loader starts; returns how many items went.

    Our uid's segments and runtime directories whose owner is dead (the
    ``gc`` rule). Never raises: a failure here must not stop a job.
    """
    if not reaping_enabled():
        return 0
    from . import admin

    try:
        items = admin.collect_garbage(dry_run=False, runtime_dir=runtime_parent)
    except Exception as exc:  # opportunistic: anything odd is for `shmloader gc`
        log.debug("shmloader: reaping at start failed: %s", exc)
        return 0
    gone = [i for i in items if i.get("removed")]
    if gone:
        log.info(
            "shmloader: removed %d leftover(s) of dead processes: %s",
            len(gone),
            ", ".join(i["name"] for i in gone[:5]) + (" ..." if len(gone) > 5 else ""),
        )
    return len(gone)
