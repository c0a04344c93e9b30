"""What this process made, removed on SIGTERM: the bottom layer of the package.

It owns the registry of the names this process created (shm segments, private
runtime directories) and of the ring tokens it writes (``own``, ``disown``,
``owned``), and the SIGTERM handler that removes them before the process dies
(NOTE [SIGTERM]). It imports nothing of shmloader, touches only what it
registered, and reads no segment header itself: ``segment`` hands it that
removal when it loads (``removes_segments``; NOTE [layers]); reaping what dead
processes left is ``reaping``'s.
"""

# NOTE [layers]
#     A module imports only modules of its own layer or of layers below it, and
#     never in a circle: imports inside a function count too (one there must not
#     hide a circle). ``tests/unit/test_layers.py`` checks the whole graph and what
#     importing a low layer loads.
#
#     1. ``errors`` and this module: the registry imports nothing of shmloader.
#        Removing a registered segment needs its header, which only
#        ``segment`` reads, so ``segment`` hands that function down when it
#        loads (``removes_segments``).
#     2. ``segment``, then ``channel`` and ``ring`` (with the pure ``wire`` and
#        ``codec``): shared memory and signalling. Nothing here imports
#        ``inventory`` or ``daemon_client``: a ring writer is given what it asks of
#        the daemon (``ring.NodeDaemon``, a ``DaemonClient`` in practice), a
#        DataLoader worker its ``PoolSpec.admit`` (NOTE [pool admission]).
#     3. ``daemon_client``; ``inventory`` (``stat``); ``reaping`` (``gc``, reaping at
#        start, with ``gc``'s rule); then ``topology``, the roles and
#        ``loader`` at the top. ``import shmloader`` loads only ``config`` and
#        ``errors``; the rest comes on first use (PEP 562).

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_segments: set[str] = set()  # shm names created by this process and still linked
_dirs: set[str] = set()  # private runtime directories made by this process
_tokens: set[str] = set()  # rings this process writes: their segments may be a child's make
_installed = False
#: Removes registered segment names and the segments of registered ring tokens
#: that name us; set by ``segment`` when it loads (NOTE [layers]).
_remove_segments: Callable[[set[str], set[str]], None] | None = None


def removes_segments(remove: Callable[[set[str], set[str]], None]) -> None:
    """Set how ``remove_owned`` removes (segment names, ring tokens): ``segment``'s call."""
    global _remove_segments
    _remove_segments = remove


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
    with _lock:
        segments, dirs, tokens = set(_segments), set(_dirs), set(_tokens)
        _segments.clear()
        _dirs.clear()
        _tokens.clear()
    if _remove_segments is not None:  # set whenever a segment or token was registered
        _remove_segments(segments, tokens)
    for path in dirs:
        with contextlib.suppress(OSError):
            remove_runtime_dir(path)  # our sockets, then the directory


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


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread
    _segments.clear()
    _dirs.clear()
    _tokens.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# NOTE [SIGTERM]
#     A process killed by SIGTERM with the default disposition runs no atexit
#     handler and no finalizer. When the first name is registered (from the
#     main thread) we look at the current disposition of SIGTERM:
#
#     - ``SIG_DFL``: we install a handler that removes the registered names,
#       restores ``SIG_DFL`` and sends SIGTERM to ourselves again: the process
#       dies of the signal as it would have (exit status -15, 143 in a shell).
#     - a Python handler of the application: we install a wrapper that calls it
#       first. If it returns, the application chose to go on and nothing is
#       removed (its normal exit runs our finalizers later); if it raises (for
#       example ``SystemExit``), the names are removed and the exception goes on.
#     - ``SIG_IGN`` or a handler installed outside Python: left alone.
#
#     Segments made on our behalf by a forked child (a DataLoader worker that
#     grows a pool slot writes our pid and start time into its header) are not
#     in this process's list of names: for each registered ring token the
#     handler also removes every ``/shml-<token>-*`` segment whose header names
#     this very process (pid and start time) as its owner. Conversely, a name
#     this process made but handed over (its header now names another owner:
#     that worker's grown slot belongs to the leader, whose later workers open
#     it by name) is left alone: a worker stopped by SIGTERM (the DataLoader's
#     own shutdown does that to a worker slow to exit) must not unlink a slot
#     of the live leader's ring. Only names whose header names us are removed
#     (``segment.remove_own_segments``).
#
#     An application that installs its own handler later replaces ours; that is
#     its right, and its normal exit path still runs our finalizers. In a forked
#     child the registry is emptied (``os.register_at_fork``): a child never
#     removes its parent's names (NOTE [creator-only cleanup] in ``segment``).
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
