"""The huge-page ring's directory for ``benchmarks.run``: a private tmpfs with 2 MiB pages.

``mount()`` makes this process (its calling thread, and every rank it
spawns afterwards) enter a private mount namespace and mounts a tmpfs with
``huge=within_size`` there, so nothing of it is visible to the rest of the
machine and the kernel frees it when the run ends. Root only; anything
else, or a kernel that gives the mount no huge pages, is a reason to skip
the way (NOTE [huge-page ring] in ``shmloader._node.ringdir``).
"""

from __future__ import annotations

import ctypes
import os
import tempfile

CLONE_NEWNS = 0x00020000
MS_REC = 16384
MS_PRIVATE = 1 << 18


def mount(size_bytes: int) -> tuple[str | None, str]:
    """``(path, how)`` of a fresh ``huge=within_size`` tmpfs, or ``(None, why not)``."""
    if os.geteuid() != 0:
        return None, "needs root (a tmpfs mounted in a private mount namespace)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return None, f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return None, f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    path = tempfile.mkdtemp(prefix="shml-bench-huge-")
    mib = max(size_bytes >> 20, 64)
    options = f"huge=within_size,size={mib}m,mode=1777"
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options.encode()) != 0:
        err = os.strerror(ctypes.get_errno())
        os.rmdir(path)
        return None, f"mount -t tmpfs -o {options}: {err}"
    from shmloader._node import ringdir

    facts = ringdir.describe(path)
    if not facts.huge:
        return None, f"the kernel gives the tmpfs no huge pages: {facts.why}"
    return path, f"tmpfs -o {options} at {path}: {facts.why}"
