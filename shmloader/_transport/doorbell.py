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
import os
import select
import weakref


class Doorbell:
    """A pipe that wakes whoever waits on its read end."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        weakref.finalize(self, _close, self._r, self._w)

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        """Wake the waiter (a full pipe already will)."""
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
