"""The sharing line: one line at a loader's first ``iter()`` saying how batches travel.

It owns the line's text (``line``: sharing on or off, the SP group and its
nodes, the ring directory and its pages, daemon or embedded and why) and where it goes
(``show``: an INFO record where the application's logging shows one, else
stderr; NOTE [the sharing line]). It reads the topology and the ring directory's
facts and touches nothing else.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .._node import ringdir
from .._topology import GroupTopology
from ..config import Config, well_known_socket

log = logging.getLogger("shmloader.loader")
_HUSH = "SHMLOADER_QUIET=1 hides this line"


def line(
    config: Config,
    ranks: list[int] | None,
    topo: GroupTopology | None,
    daemon: Any,
    me: int,
    world: int,
) -> str | None:
    """The line this rank says at its first ``iter()``, or None (NOTE [the sharing line])."""
    if config.quiet or not (me == 0 or (topo is not None and topo.is_leader)):
        return None
    if topo is None:
        if ranks is None or len(ranks) < 2:
            why = "no group of more than one rank to share with" + (
                " (SHMLOADER=1 is set, but group is None or of size 1)" if config.enabled else ""
            )
        else:
            why = f"SP group {ranks}; SHMLOADER=1 shares one loader per group"
        return f"shmloader: sharing off: every rank runs its own loader ({why}); {_HUSH}"
    nodes = " | ".join(str(list(n)) for n in topo.nodes)
    count = len(topo.nodes)
    facts = ringdir.describe(config.shm_dir)
    owner = _owner(config, daemon)
    return (
        f"shmloader: sharing on: SP group {list(topo.ranks)} on {count} "
        f"node{'s' if count > 1 else ''} ({nodes}), leader rank {topo.leader}, "
        f"{world // len(topo.ranks)} group(s) in a world of {world}; ring in {facts.path} "
        f"({facts.why}); {owner}; {_HUSH}"
    )


def _owner(config: Config, daemon: Any) -> str:
    """Who owns the ring's memory: the daemon, or embedded and why (NOTE [finding the
    daemon] in ``config``)."""
    if config.daemon is None:
        return "embedded (no daemon: SHMLOADER_DAEMON=off)"
    if daemon is not None and getattr(daemon, "state", "up") == "up":
        return f"daemon at {config.daemon}"
    if config.daemon == well_known_socket() and not os.path.exists(config.daemon):
        return f"embedded (no daemon at {config.daemon}; one started later is joined)"
    return f"embedded (the daemon at {config.daemon} did not answer; asked again later)"


# NOTE [the sharing line]
#     Runs with sharing on and off must not look the same. At the first
#     ``iter()`` of a ``ShmLoader`` one line says whether sharing is on, the
#     SP group and its nodes, the ring directory and its pages, and whether
#     a node daemon or the embedded mode owns the shared memory. It is said
#     by global rank 0 and, with sharing on, by each SP group's leader (the
#     rank that speaks for its group), once per ``ShmLoader``; set-up errors
#     are raised as before. Python's default logging shows no INFO record,
#     so the line is an INFO record of ``shmloader.loader`` only where the
#     application's logging shows one (a handler and INFO enabled), else
#     printed to stderr. ``SHMLOADER_QUIET=1`` (``Config.quiet``) silences it.
def show(text: str) -> None:
    """Say ``text`` where the user sees it (NOTE [the sharing line])."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(text)
    else:
        print(text, file=sys.stderr, flush=True)
