"""``Doorbell``: how any thread wakes a loader's producer at once, without a lock.

It owns one non-blocking pipe. ``ring`` writes a byte (from any thread, from a
finalizer, even inside the producer's own socket call: it takes no lock and
never blocks); the producer waits on it alone (``wait``) or beside its sockets
(``fileno`` in a ZeroMQ poller, ``channel``), and ``clear`` empties it. The pipe
closes when the last thing that could ring it is gone (its finalizer), so a late
ring never writes into a reused descriptor. It imports nothing of shmloader's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import weakref


def _write_holding_the_gil() -> object | None:
    """libc's ``write``, called without letting go of the GIL (``PyDLL``)."""
    try:
        fn = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_ssize_t
    return fn


# NOTE [a ring keeps the GIL]
#     ``os.write`` lets go of the GIL around its system call, and a producer
#     woken by that very byte takes it: the ringing thread (the user's, in
#     ``next()``) then waits for the GIL while the producer makes its next
#     batch, up to a millisecond or two. A byte into a non-blocking pipe never
#     blocks, so ``ring`` writes it holding the GIL, and the producer runs once
#     the ringing thread lets go of the GIL anyway (its next blocking call, or
#     the interpreter's switch interval).
_WRITE = _write_holding_the_gil()


class Doorbell:
    """A pipe that wakes whoever waits on its read end."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        weakref.finalize(self, _close, self._r, self._w)

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        """Wake the waiter (a full pipe already will), keeping the GIL (NOTE [a ring keeps
        the GIL])."""
        if _WRITE is not None:
            _WRITE(self._w, b"!", 1)  # type: ignore[operator]  # -1 (EAGAIN: full, EBADF): as os.write's
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"!")

    def clear(self) -> None:
        """Take every ring so far."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._r, 4096):
                pass

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a ring; whether one came (then cleared)."""
        try:
            ready, _, _ = select.select([self._r], [], [], timeout)
        except (OSError, ValueError):  # closed under us
            return False
        if ready:
            self.clear()
        return bool(ready)


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
