"""``sd_notify`` by hand: one datagram to ``$NOTIFY_SOCKET`` per state change.

It owns ``notify`` (READY, WATCHDOG, STOPPING, STATUS: docs/internals/wire.md)
and ``watchdog_interval``. Without ``NOTIFY_SOCKET`` every call is a no-op, so
the daemon runs the same under systemd, in a container or in a test; it touches
only that socket.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("shmloaderd")


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr.startswith("@"):
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    log.warning("NOTIFY_SOCKET=%r is neither a path nor @abstract; not notifying", addr)
    return None


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); True when a notify socket took it."""
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), addr)
        return True
    except OSError as exc:
        log.warning("sd_notify(%s) to %r failed: %s", state.split("\n")[0], addr, exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of WATCHDOG_USEC), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; no watchdog pings", usec)
        return None
    return value / 2e6 if value > 0 else None
