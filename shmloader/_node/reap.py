"""Reaping our own dead leftovers when a loader starts.

``reap_own`` removes our uid's segments and runtime directories whose owner
is dead (NOTE [reaping rule] in ``admin``, the same rule ``shmloader gc``
applies). ``SHMLOADER_REAP=0`` switches it off (the test suite does, so that
it never touches other runs' leftovers). What SIGTERM removes is
``cleanup``'s, a layer below (NOTE [layers] in ``cleanup``).
"""

from __future__ import annotations

import logging
import os

from . import inventory as admin

log = logging.getLogger(__name__)


def reaping_enabled() -> bool:
    return os.environ.get("SHMLOADER_REAP", "1").strip().lower() not in ("0", "false", "off")


def reap_own(runtime_parent: str | None = None) -> int:
    """Opportunistic reaping when a loader starts; returns how many items went.

    Our uid's segments and runtime directories whose owner is dead (the
    ``gc`` rule). Never raises: a failure here must not stop a job.
    """
    if not reaping_enabled():
        return 0
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
