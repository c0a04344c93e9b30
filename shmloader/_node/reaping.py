"""The reaping rule (``shmloader gc``): what dead owners left, and removing it.

Owns the rule (NOTE [reaping rule]) and the one place that unlinks another
process's leftovers: ``collect_garbage`` (``shmloader gc``, the daemon's
reaper) and ``reap_own`` (a starting loader's opportunistic pass over its
own uid, off with ``SHMLOADER_REAP=0``). Reads what ``inventory`` scans;
what SIGTERM removes is ``cleanup``'s (NOTE [layers] in ``cleanup``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError
from . import segment
from .cleanup import remove_runtime_dir
from .inventory import scan_entries
from .rundir import private_dirs
from .segment import (
    ANY_UID,
    KIND_CONTROL,
    PREFIX,
    owner_alive,
    proc_start_time,
    shm_path,
    unlink_name,
    validate,
)

log = logging.getLogger(__name__)

_SOCKET_NAME = re.compile(r"^(?P<token>[0-9A-Za-z]{1,64})-(?P<pid>[0-9]{1,10})\.sock$")


@dataclass
class Freed:
    """What ``gc``/the reaper removed (or would remove)."""

    type: str  # "segment" | "socket" | "rundir"
    name: str
    bytes: int = 0
    kind: str = ""
    token: str = ""
    owner_pid: int = 0
    removed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {
            "type": self.type,
            "name": self.name,
            "bytes": self.bytes,
            "kind": self.kind,
            "token": self.token,
            "owner_pid": self.owner_pid,
            "removed": self.removed,
        }
        out.update(self.extra)
        return out


def remove_if_dead(
    name: str, *, dry_run: bool = False, every_uid: bool = False, directory: str | None = None
) -> Freed | None:
    """Re-validate ``name`` and unlink it if its owner is dead (NOTE [reaping rule]).

    The checks run on one open descriptor, and the name is unlinked only while
    it still is that file (same device and inode). ``every_uid``: a dead
    owner's segment of any uid (root only). ``directory``: the ring directory
    it is named in (default: this process's).

    NOTE [reaping rule]
        An entry ``/dev/shm/shml-*`` is considered only when it is a regular file
        of our uid with mode 0600 whose header passes ``segment.validate`` (magic,
        version, kind, uid, size) and whose name carries the header's token
        (``/shml-<token>-...``). It is garbage only when its owner, the
        (pid, start time) in the header, is not running: a recycled pid has
        another start time and does not keep a dead job's segment alive. Nothing
        failing validation is ever removed, nothing of a live owner either. The
        same rule drives ``shmloaderd``'s reaper. Owners are checked in our pid
        namespace: the daemon, ``gc`` and the jobs must share it.

        Every uid (``every_uid``): root's ``gc`` and ``shmloaderd`` in node mode
        apply the same rule to the segments and private runtime directories of
        every user: a segment of another uid counts only when its header names
        that uid (the file's owner), is mode 0600, and its owner is dead. The
        unlink happens on a re-check made through the open descriptor: the name
        must still be the very file (device and inode) that was validated and
        found dead, so nothing put at that name since is removed. A user's
        ``gc`` sees only its own uid's files (the rule above); the opportunistic
        reaping of a starting loader stays on its own uid even as root.
    """
    with segment.in_dir(directory or segment.ring_dir()):
        return _remove_if_dead(name, dry_run=dry_run, every_uid=every_uid)


def _remove_if_dead(name: str, *, dry_run: bool, every_uid: bool) -> Freed | None:
    try:
        fd = os.open(shm_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        h = validate(fd, name, kind=None, token=None, owner=ANY_UID if every_uid else None)
        if not name.startswith(f"/{PREFIX}{h.token}-") or owner_alive(h):
            return None
        freed = Freed(
            "segment",
            name,
            st.st_size,
            h.kind_name,
            h.token,
            h.pid,
            extra={"owner_start": h.start, "uid": st.st_uid},
        )
        if not dry_run:
            now = os.lstat(shm_path(name))
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None  # the name was given to another file since: not ours to judge
            freed.removed = unlink_name(name)
        return freed
    except (ProtocolError, OSError):
        return None
    finally:
        os.close(fd)


def runtime_bases(runtime_dir: str | None = None, *, every_uid: bool = False) -> list[str]:
    """Every runtime base we know of, once each: ``runtime_dir``,
    ``$SHMLOADER_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR``, ``/run/user/<uid>``, ``/tmp``
    (with ``every_uid``: every ``/run/user/<uid>``)."""
    bases = [
        runtime_dir,
        os.environ.get("SHMLOADER_RUNTIME_DIR"),
        os.environ.get("XDG_RUNTIME_DIR"),
        f"/run/user/{os.geteuid()}",
        "/tmp",
    ]
    if every_uid:
        try:
            users = sorted(n for n in os.listdir("/run/user") if n.isdigit())
        except OSError:
            users = []
        bases += [f"/run/user/{n}" for n in users]
    return list(dict.fromkeys(b for b in bases if b))


def runtime_dirs(runtime_dir: str | None = None) -> list[str]:
    """Our uid's shared socket directories of the older layout, under every runtime base.

    ``shmloader-<uid>`` and ``shmloader-<uid>-*`` in each of
    :func:`runtime_bases` (jobs of earlier versions; today each writer has a
    private ``shml-...`` directory: :func:`dead_runtime_dirs`). Only real
    directories (no symlink) owned by us and closed to others count.
    """
    uid = os.geteuid()
    out: list[str] = []
    for base in runtime_bases(runtime_dir):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in sorted(names):
            if name != f"shmloader-{uid}" and not name.startswith(f"shmloader-{uid}-"):
                continue
            path = os.path.join(base, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            private = stat.S_IMODE(st.st_mode) & 0o077 == 0
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and private:
                out.append(path)
    return out


def _started_unix(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch; None if it is gone."""
    ticks = proc_start_time(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return 0.0
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def stale_sockets(runtime_dir: str | None = None) -> list[str]:
    """Socket files ``<token>-<pid>.sock`` of ours whose process is gone.

    Gone: the pid is not running, or it started after the socket was made (a
    recycled pid; one second of slack for the clocks' granularity).
    """
    out = []
    for path in runtime_dirs(runtime_dir):
        try:
            names = os.listdir(path)
        except OSError:
            continue
        for name in sorted(names):
            m = _SOCKET_NAME.match(name)
            if m is None:
                continue
            full = os.path.join(path, name)
            try:
                fst = os.lstat(full)
            except OSError:
                continue
            if not (stat.S_ISSOCK(fst.st_mode) and fst.st_uid == os.geteuid()):
                continue
            started = _started_unix(int(m["pid"]))
            if started is None or started > fst.st_mtime + 1.0:
                out.append(full)
    return out


def dead_runtime_dirs(runtime_dir: str | None = None, *, every_uid: bool = False) -> list[str]:
    """Private runtime directories (``shml-<pid>...``) of ours whose owner is dead.

    Looked for under the same bases as :func:`runtime_dirs`; the rule is
    ``rundir.private_dirs`` (an owner in another pid namespace counts as alive).
    ``every_uid``: every user's (root only; NOTE [reaping rule]).
    """
    dead = []
    for base in runtime_bases(runtime_dir, every_uid=every_uid):
        dead += [p for p, _pid, alive in private_dirs(base, every_uid=every_uid) if not alive]
    return dead


def collect_garbage(
    dry_run: bool = False,
    runtime_dir: str | None = None,
    *,
    tokens: set[str] | None = None,
    owners: set[int] | None = None,
    jobs: set[str] | None = None,
    every_uid: bool = False,
    dirs: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Remove (or with ``dry_run`` only list) what dead owners left: segments, sockets, dirs.

    ``tokens`` and ``owners`` (pids) narrow it to those rings or processes
    (the test suite scopes its gc so that it never touches other runs);
    ``jobs`` to the rings whose description names one of those jobs
    (``SHMLOADER_JOB`` or the launcher's run id: the ``JOB`` column of
    ``stat``), found by their control segments. ``every_uid``: every user's
    leftovers, not only our uid's (root's ``shmloader gc``; NOTE [reaping rule]).
    ``dirs``: the ring directories to look in (``ring_dirs()`` by default).
    Returns one dict per item: ``type`` ("segment"|"socket"|"rundir"),
    ``name``, ``bytes``, ``kind``, ``token``, ``owner_pid``, ``removed``.
    """
    out: list[dict[str, Any]] = []
    entries = scan_entries(every_uid=every_uid, dirs=dirs)
    if jobs is not None:
        named = {
            e.header.token
            for e in entries
            if e.header is not None
            and e.header.kind == KIND_CONTROL
            and (e.description or {}).get("job") in jobs
        }
        tokens = named if tokens is None else tokens & named
    for entry in entries:
        h = entry.header
        if h is None or entry.alive:
            continue
        if (tokens is not None and h.token not in tokens) or (
            owners is not None and h.pid not in owners
        ):
            continue
        freed = remove_if_dead(
            entry.name, dry_run=dry_run, every_uid=every_uid, directory=entry.directory
        )
        if freed is not None:
            out.append(freed.as_dict())
    for path in stale_sockets(runtime_dir):
        m = _SOCKET_NAME.match(os.path.basename(path))
        assert m is not None
        if (tokens is not None and m["token"] not in tokens) or (
            owners is not None and int(m["pid"]) not in owners
        ):
            continue
        item = Freed("socket", path, token=m["token"], owner_pid=int(m["pid"]))
        if not dry_run:
            try:
                os.unlink(path)
                item.removed = True
            except FileNotFoundError:
                pass
        out.append(item.as_dict())
    for path, pid, alive in private_dirs(runtime_dir, every_uid=every_uid):
        if alive or tokens is not None or (owners is not None and pid not in owners):
            continue  # a runtime directory carries no token
        item = Freed("rundir", path, owner_pid=pid)
        if not dry_run:
            item.removed = remove_runtime_dir(path)
        out.append(item.as_dict())
    return out


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
        items = collect_garbage(dry_run=False, runtime_dir=runtime_parent)
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
