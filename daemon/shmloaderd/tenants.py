"""Node mode: one daemon for every user of the node.

Started as root (or with ``--tenants``) shmloaderd serves every uid, its socket
0666 in a 0755 directory; started as an ordinary user it serves that user only
(0600 in 0700). It owns who asks (``peer_of``: the ``SO_PEERCRED`` of the
connection, never a message field), the check of every request against that peer
(``Tenancy.check``: NOTE [tenants]) and the per-uid budgets (``UidBudgets``). It
reads ``/proc/<pid>/status`` and touches nothing else.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shmloader._node import segment
from shmloader._node.inventory import process_uid

log = logging.getLogger("shmloaderd")


@dataclass(frozen=True)
class Peer:
    """The credentials of one client connection (``SO_PEERCRED``)."""

    uid: int
    gid: int
    pid: int

    @property
    def root(self) -> bool:
        return self.uid == 0

    def __str__(self) -> str:
        return f"uid {self.uid} ({user_name(self.uid)}) pid {self.pid}"


# NOTE [tenants]
#     Who asks is the kernel's answer, not the client's: ZeroMQ reports each
#     ipc connection's ``SO_PEERCRED`` as the message property ``Peer-Address``
#     (``...:<uid>:<gid>:<pid>``), read for every request (``peer_of``). A
#     request of a non-root peer is refused (and logged) when it names
#
#     - a pid of another uid (``register``'s ``pids``, ``admit``'s and
#       ``adopt``'s ``pid``) that runs in our pid namespace: its effective uid
#       is read from ``/proc/<pid>/status``. A pid of another namespace cannot
#       be checked here and is never judged by the daemon either (NOTE [pid
#       namespaces] in ``registry``), so it can affect nothing.
#
#     A token cannot name another uid's job at all: every request acts on the
#     job of that token *of the peer's uid* (NOTE [whose job] in ``registry``),
#     so naming another user's token reaches only a job of one's own. Root
#     peers may name anything. What a peer sees (``stat``) is cut to its
#     uid by ``server.Daemon.view``; what it may take (``admit``, ``adopt``) is
#     bounded by its uid's budget (``UidBudgets``, NOTE [budget] in
#     ``registry``), and a pooled segment it adopts is handed over with
#     ``fchown`` to it and mode 0600 before its name is linked (``pool``).
def peer_of(frame: Any) -> Peer | None:
    """The peer of a received ZeroMQ frame (``Peer-Address`` of an ipc connection).

    libzmq appends ``:<uid>:<gid>:<pid>`` from ``SO_PEERCRED`` to the address
    of a unix-socket peer. None when the property is missing or malformed.
    """
    try:
        text = frame.get("Peer-Address")
    except Exception:  # an old libzmq without the property
        return None
    parts = str(text).rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


def user_name(uid: int | None) -> str:
    """Login name of ``uid``, or the number as text."""
    if uid is None:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _foreign(pidns: int | None) -> bool:
    return bool(pidns and segment.MY_PIDNS and pidns != segment.MY_PIDNS)


def parse_uid(text: str) -> int:
    """``"1001"`` or a login name -> uid; ValueError naming the value."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ValueError(f"{text!r} is neither a uid nor a user of this node") from None


class UidBudgets:
    """Per-uid budgets: ``--uid-budget UID=SIZE|PCT%`` and ``--default-uid-budget``."""

    def __init__(
        self,
        per_uid: dict[int, Callable[[], int | None]] | None = None,
        default: Callable[[], int | None] | None = None,
    ) -> None:
        self.per_uid = dict(per_uid or {})
        self.default = default

    def __call__(self, uid: int | None) -> int | None:
        """The budget of ``uid`` in bytes now; None: only the node budget applies."""
        if uid is None:
            return None
        fn = self.per_uid.get(uid, self.default)
        return None if fn is None else fn()

    @property
    def any(self) -> bool:
        return bool(self.per_uid) or self.default is not None


class Tenancy:
    """Whether node mode is on, and the check of each request against its peer."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def uid_of(self, peer: Peer | None) -> int:
        """The uid a request acts for: the peer's in node mode, else ours."""
        if self.enabled and peer is not None:
            return peer.uid
        return os.geteuid()

    def check(self, op: str, fields: dict[str, Any], peer: Peer | None) -> str | None:
        """Why ``peer`` may not make this request (NOTE [tenants]); None when it may.

        A token names nothing of another uid's (NOTE [whose job] in
        ``registry``): only the pids a request names are checked here.
        """
        if not self.enabled:
            return None
        if peer is None:
            return "the daemon cannot tell who is asking (no peer credentials); refused"
        if peer.root:
            return None
        pids: list[tuple[int, int | None]] = []
        if op == "register":
            ns = fields.get("pids_ns", {})
            pids = [(pid, ns.get(rank)) for rank, (pid, _start) in fields["pids"].items()]
        elif op in ("admit", "adopt") and "pid" in fields:
            pids = [(fields["pid"], fields.get("pidns"))]
        for pid, pidns in pids:
            if _foreign(pidns):
                continue  # cannot be checked here, and is never judged here (NOTE [tenants])
            uid = process_uid(pid)
            if uid is not None and uid != peer.uid:
                return (
                    f"pid {pid} belongs to uid {uid}, not to uid {peer.uid}: name only "
                    "processes of your own"
                )
        return None
