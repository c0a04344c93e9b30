"""``shmloader stat`` and ``shmloader gc``: what shmloader holds on this node.

Both work from the segment headers in ``/dev/shm`` alone; ``stat`` asks
``shmloaderd`` instead when ``--daemon PATH`` or ``SHMLOADER_DAEMON`` names a
reachable control socket (the daemon adds what only it knows: follower lag
and receive times, the node budget). ``cli.py`` calls :func:`register` to add
both subcommands; tests call :func:`scan` and :func:`collect_garbage`.

What counts as ours (NOTE [reaping rule])
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

NOTE [every ring directory]
    ``gc`` and ``stat`` look in every ring directory the node's jobs may use,
    without being told: /dev/shm, ``SHMLOADER_SHM_DIR`` when set, the
    daemon's ``--shm-dir`` list (its ``hello`` says them, when the daemon
    answers) and the directory of the shipped systemd mount
    (``ringdir.SYSTEMD_RING_DIR``) when it exists (``node_ring_dirs``).
    Before, ``gc`` without ``SHMLOADER_SHM_DIR`` reported "nothing to
    collect" while dead jobs' segments sat in the huge-page directory. The
    table names each directory with its own size and room in its header,
    and where a job's ring is on the job's own lines, never a directory it
    is not in (nor ``None`` for a dead job's record, which has none).

Where ``stat`` gets its document
    ``--daemon PATH``, else ``SHMLOADER_DAEMON``, else the system daemon's
    default socket (``/run/shmloader/control.sock``) when it exists; if none
    answers, a scan of /dev/shm. The writer of each ring rewrites the ring's
    description once a second with per-rank rows, so a scan shows progress
    and the leader's wait for data too; only the daemon knows followers'
    own wait times (they report to it). The same holds for device delivery:
    the writer's row carries its own ``device*`` fields; a follower's come
    with its reports to the daemon.

What a job's bytes mean (NOTE [honest bytes])
    ``bytes`` is what the job holds in /dev/shm now, and nothing else: for a
    live job its segments named in /dev/shm plus the unlinked ones that its
    processes (the writer and the ranks its ring describes) still map, each
    file once (``/proc/<pid>/maps``; tmpfs frees a file when its last name and
    mapping are gone). Neither the ring's counters nor what the daemon has
    granted but not yet seen allocated (``granted_pending_bytes``, what
    admission reserves) count. For a dead job (writer gone) only the segments
    still named can hold memory, so ``bytes`` is exactly what ``gc`` frees
    (``reclaimable_bytes``). Traffic (payload bytes a rank published or
    received since it started) is ``traffic_bytes`` of a rank row: it grows
    with every batch and says nothing about memory.

Dead jobs (daemon)
    When shmloaderd reaps a job whose processes died (SIGKILL, OOM), the job
    stays in its document for ``registry.ENDED_KEEP_S`` seconds as ``state:
    "dead"`` with ``ended`` saying when, why and what was reaped (``bytes``
    0: nothing is held any more). Without a daemon nothing reaps it: the scan
    shows it ``dead`` until ``shmloader gc``.

``stat --json`` document, schema 3 (fields are only ever added within a
schema; schema 2 added ``job``, ``started_unix``, ``age_s``,
``reclaimable_bytes``, ``ranks`` and made a dead job's ``bytes`` what ``gc``
frees; later, within schema 2, the ``device*`` fields of ``ranks`` rows, and
node mode's ``uid``, ``user``, ``others`` and ``daemon.tenants``,
``budget_left_bytes`` and ``uids``; schema 3 made ``bytes`` what /dev/shm
holds (no pending grants), renamed the rank rows' ``bytes`` (traffic) to
``traffic_bytes``, added ``wait_ms_p95``/``wait_ms_p99``,
``granted_pending_bytes``, ``ended`` and ``notes``; later, within schema 3,
``node.shm_dirs`` and a job's ``shm_dir`` and ``huge_pages``: the ring
directories and what backs them, NOTE [huge-page ring] in ``ringdir``)::

    {
      "schema": 3,
      "source": "daemon" | "scan",     # who built it
      "time_unix": float,
      "node": {"hostname": str, "shm_dir": "/dev/shm",
               "shm_size_bytes": int|null, "shm_free_bytes": int|null,
               "shmloader_bytes": int,  # sum of "bytes" of all jobs (+ the warm pool)
               "shm_dirs": [{           # every ring directory scanned (/dev/shm,
                                        # SHMLOADER_SHM_DIR, the daemon's --shm-dir)
                 "path": str, "fs": str, "mount": str, "huge_option": str,
                 "shmem_enabled": str, "mode": str, "owner": int,
                 "huge": bool,          # files there get 2 MiB pages (probed)
                 "advise": bool,        # ... only through MADV_HUGEPAGE
                 "why": str, "size_bytes": int|null, "free_bytes": int|null}]},
      "daemon": null | {"pid": int, "version": str, "socket": str,
               "budget_bytes": int|null,
               "in_use_bytes": int,     # what admission counts: jobs' bytes, their
                                        # pending grants and the warm pool
               "granted_pending_bytes": int,
               "uptime_s": float,
               "reaped_segments": int, "reaped_bytes": int, "reaped_sockets": int,
               "pool_bytes": int, "pool_segments": int,
               "connections_shed": int,  # closed past --max-uid-connections
               "budget_left_bytes": int|null,   # of the node budget
               "tenants": bool,                 # node mode: every user of the node served
               "uids": {"<uid>": {"user": str, "jobs": int, "bytes": int,
                                  "budget_bytes": int|null, "budget_left_bytes": int|null,
                                  "reaped_segments": int, "reaped_bytes": int,
                                  "admissions_granted": int, "admissions_refused": int,
                                  "connections": int}}},  # to the control socket now
                                        # a user's view: its own uid's row only
      "others": {"jobs": int, "bytes": int},   # only in a user's view of a node-mode
                                        # daemon: the rest of the node, as totals
      "jobs": [                         # one per ring: an SP group on this node
        {"token": str,
         "job": str|null,               # SHMLOADER_JOB, TORCHELASTIC_RUN_ID or SLURM_JOB_ID
         "started_unix": float|null,    # when the ring was made
         "age_s": float|null,
         "state": "live" | "dead" | "closed" | "unknown",
         "registered": bool,            # told to the daemon (false in a scan)
         "group": [int]|null, "leader": int|null, "writer": int|null,
         "node_ranks": [int]|null, "world": int|null,
         "pids": {"<rank>": [pid, start, pidns]},
         "uid": int|null, "user": str|null,  # whose job (its control segment's owner)
         "writer_pid": int|null, "writer_alive": bool|null,
         "segments": [{"name": str, "kind": "control"|"data"|"probe",
                       "bytes": int, "owner_pid": int, "owner_alive": bool}],
         "shm_dir": str|null,           # the ring directory its segments are in
         "huge_pages": bool|null,       # that directory gives 2 MiB pages
         "segment_bytes": int,          # named in /dev/shm now
         "bytes": int,                  # held in /dev/shm now (NOTE [honest bytes])
         "reclaimable_bytes": int,      # what `shmloader gc` would free now
         "granted_pending_bytes": int,  # admitted by the daemon, not in /dev/shm yet
         "ended": null | {"unix": float, "why": str,   # a dead job the daemon reaped
                          "reaped_segments": int, "reaped_bytes": int},
         "slots": int|null, "ring_bytes": int|null,
         "published": int|null,         # batches written by the writer
         "bytes_published": int|null,   # payload bytes written (traffic)
         "publish_ms_avg": float|null,
         "last_publish_unix": float|null,
         "readers": int|null,
         "ranks": {"<rank>": {          # every rank of the ring on this node
             "role": "leader"|"node leader"|"follower"|null,
             "batches": int|null,       # published (writer) or received
             "wait_ms_p50": float|null, # wait for a batch over its recent 256-512
             "wait_ms_p95": float|null, # batches (fixed buckets, 19% apart:
             "wait_ms_p99": float|null, # shmloader._proto.waits)
             "wait_share": float|null,  # share of wall time since its first batch spent
                                        # waiting for data: near 1 = data is the bottleneck
             "lag": int|null,           # batches published but not yet taken
             "traffic_bytes": int|null, # payload bytes published or received so far
             "updated_unix": float|null,
             # device delivery (ShmLoader(device=...)); all null for a rank
             # without one, or one whose report has not arrived:
             "device": str|null,        # e.g. "cuda:0"
             "device_batches": int|null,          # batches handed over on the device
             "device_bytes": int|null,            # bytes copied to the device
             "device_copy_ms_total": float|null,  # copy time (the copies' events)
             "device_bandwidth_gbs": float|null,  # device_bytes / copy time, GB/s
             "device_registered": bool|null,      # copies read the CUDA-registered ring
             "device_registration_refused": str|null}},  # why CUDA refused, if it did
         "followers": {"<rank>": {"consumed": int|null, "lag": int|null,
                                  "receive_ms": float|null, "updated_unix": float}}}
      ],
      "invalid": [{"name": str, "error": str}],  # shml-* entries we refuse to touch
      "notes": [str]                    # what the document cannot show, and why
    }

Followers' waits reach only the daemon (each rank reports its own); a scan
has the writer's rows from the ring's description, so there a follower's
``wait_ms_*`` are null and ``notes`` says so.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .._transport import daemon_client
from .._transport.channel import private_dirs
from ..errors import ProtocolError, human_bytes
from . import ringdir, segment
from .cleanup import remove_runtime_dir
from .ring import COUNTER_FIELDS
from .segment import (
    ANY_UID,
    HEADER_SIZE,
    KIND_CONTROL,
    PREFIX,
    Header,
    list_segments,
    owner_alive,
    proc_start_time,
    process_alive,
    shm_free_bytes,
    shm_path,
    shm_size_bytes,
    unlink_name,
    validate,
)

SCHEMA = 3
_COUNTERS = struct.Struct("<" + "Q" * len(COUNTER_FIELDS))
_COUNTERS_AT = 64
_DESCR_LEN = struct.Struct("<I")
_SOCKET_NAME = re.compile(r"^(?P<token>[0-9A-Za-z]{1,64})-(?P<pid>[0-9]{1,10})\.sock$")


# ------------------------------------------------------------------ inspection


@dataclass
class Entry:
    """One ``shml-*`` name in a ring directory: validated (``header``) or not (``error``)."""

    name: str
    directory: str = ""  # the ring directory it is named in (``ring_dirs``)
    header: Header | None = None
    error: str = ""
    size: int = 0
    counters: dict[str, int] | None = None
    description: dict[str, Any] | None = None
    alive: bool = False
    inode: int = 0
    uid: int | None = None  # the file's owner (known once it could be opened)

    @property
    def valid(self) -> bool:
        return self.header is not None


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


def inspect(name: str, *, every_uid: bool = False) -> Entry | None:
    """Validate one segment by name (NOTE [reaping rule]); None if it vanished.

    ``every_uid``: a segment of any uid counts (root's node-wide view).
    """
    entry = Entry(name)
    try:
        fd = os.open(shm_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        entry.error = f"cannot open: {exc.strerror}"
        return entry
    try:
        st = os.fstat(fd)
        entry.uid = st.st_uid
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{name} is not a regular file")
        owner = ANY_UID if every_uid else None
        header = validate(fd, name, kind=None, token=None, owner=owner)
        if not name.startswith(f"/{PREFIX}{header.token}-"):
            raise ProtocolError(f"{name} carries token {header.token!r}, not the one in its name")
        entry.size = st.st_size
        entry.inode = st.st_ino
        if header.kind == KIND_CONTROL:
            entry.counters, entry.description = _read_control(fd, header)
        entry.header = header
        entry.alive = owner_alive(header)
    except ProtocolError as exc:
        entry.error = str(exc)
    except OSError as exc:
        entry.error = f"cannot read: {exc.strerror}"
    finally:
        os.close(fd)
    return entry


def _read_control(fd: int, header: Header) -> tuple[dict[str, int] | None, dict | None]:
    raw = os.pread(fd, _COUNTERS.size, _COUNTERS_AT)
    counters = None
    if len(raw) == _COUNTERS.size:
        counters = dict(zip(COUNTER_FIELDS, _COUNTERS.unpack(raw), strict=True))
    description = None
    for _ in range(3):  # the writer rewrites it once a second: a torn read is retried
        raw_len = os.pread(fd, _DESCR_LEN.size, HEADER_SIZE)
        if len(raw_len) != _DESCR_LEN.size:
            break
        (length,) = _DESCR_LEN.unpack(raw_len)
        if not 0 < length <= header.capacity - _DESCR_LEN.size:
            break
        try:
            parsed = json.loads(os.pread(fd, length, HEADER_SIZE + _DESCR_LEN.size))
        except ValueError:
            continue
        if isinstance(parsed, dict):
            description = parsed
        break
    return counters, description


def ring_dirs(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ring directories to scan: ``/dev/shm``, this process's ring directory
    (``SHMLOADER_SHM_DIR``), then ``extra`` (a daemon's ``--shm-dir``); each
    existing directory once."""
    out: list[str] = []
    seen: set[str] = set()
    for d in (ringdir.DEFAULT, segment.SHM_DIR, ringdir.from_env(), *extra):
        real = os.path.realpath(d)
        if real not in seen and os.path.isdir(d):
            seen.add(real)
            out.append(d)
    return out


def node_ring_dirs(daemon: str | None = None, timeout: float = 1.0) -> list[str]:
    """Every ring directory this node's jobs may use (NOTE [every ring directory]):
    ``ring_dirs`` plus the daemon's ``--shm-dir`` list (from its ``hello``, when
    ``daemon`` names a socket that answers) and the systemd mount's directory."""
    extra: list[str] = []
    if daemon:
        client = daemon_client.DaemonClient(daemon, timeout=timeout)
        try:
            hello = client.request("hello")
        finally:
            client.close()
        dirs = (hello or {}).get("shm_dirs")
        if isinstance(dirs, list):
            extra += [d for d in dirs if isinstance(d, str) and os.path.isabs(d)]
    return ring_dirs([*extra, ringdir.SYSTEMD_RING_DIR])


def daemon_path(daemon: str | None = None) -> str | None:
    """The daemon socket ``stat``/``gc`` ask: ``--daemon``, ``SHMLOADER_DAEMON``, else
    the system daemon's default socket when it exists."""
    path = daemon or os.environ.get("SHMLOADER_DAEMON") or None
    if path is None and os.path.exists(daemon_client.DEFAULT_SOCKET):
        path = daemon_client.DEFAULT_SOCKET
    return path


def dir_row(directory: str) -> dict[str, Any]:
    """A ring directory as the stat document shows it: what backs it, its size and room."""
    row: dict[str, Any] = ringdir.describe(directory).as_dict()
    with segment.in_dir(directory):
        row["size_bytes"], row["free_bytes"] = shm_size_bytes(), shm_free_bytes()
    return row


def scan_entries(*, every_uid: bool = False, dirs: list[str] | None = None) -> list[Entry]:
    """Every ``shml-*`` entry of the ring directories (``ring_dirs``), validated
    (of any uid with ``every_uid``)."""
    out: list[Entry] = []
    for directory in ring_dirs() if dirs is None else dirs:
        with segment.in_dir(directory):
            for name in list_segments():
                if (e := inspect(name, every_uid=every_uid)) is not None:
                    e.directory = directory
                    out.append(e)
    return out


def token_entries(
    token: str, *, every_uid: bool = False, dirs: list[str] | None = None
) -> list[Entry]:
    """The entries of ring ``token`` alone, validated: what ``scan_entries`` gives
    for it, without reading any other ring's headers."""
    prefix = f"/{PREFIX}{token}-"
    out: list[Entry] = []
    for directory in ring_dirs() if dirs is None else dirs:
        with segment.in_dir(directory):
            for name in list_segments():
                if name.startswith(prefix) and (e := inspect(name, every_uid=every_uid)):
                    e.directory = directory
                    out.append(e)
    return out


def remove_if_dead(
    name: str, *, dry_run: bool = False, every_uid: bool = False, directory: str | None = None
) -> Freed | None:
    """Re-validate ``name`` and unlink it if its owner is dead (NOTE [reaping rule]).

    The checks run on one open descriptor, and the name is unlinked only while
    it still is that file (same device and inode). ``every_uid``: a dead
    owner's segment of any uid (root only). ``directory``: the ring directory
    it is named in (default: this process's).
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


# -------------------------------------------------------------------- document


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def job_from_entries(token: str, entries: list[Entry]) -> dict[str, Any]:
    """One job (ring) of the stat document, from its segments in /dev/shm."""
    ctl = next((e for e in entries if e.header and e.header.kind == KIND_CONTROL), None)
    desc = (ctl.description if ctl else None) or {}
    counters = ctl.counters if ctl else None
    segments: list[dict[str, Any]] = [
        {
            "name": e.name,
            "kind": e.header.kind_name,
            "bytes": e.size,
            "owner_pid": e.header.pid,
            "owner_alive": e.alive,
        }
        for e in entries
        if e.header is not None
    ]
    named = sum(s["bytes"] for s in segments)
    owner = ctl or next((e for e in entries if e.header is not None), None)
    uid = owner.header.uid if owner is not None and owner.header is not None else None
    job_name = desc.get("job")
    job: dict[str, Any] = {
        **empty_job(token),
        "job": job_name[:128] if isinstance(job_name, str) else None,
        "group": _int_list(desc.get("group")),
        "leader": _opt_int(desc.get("leader")),
        "writer": _opt_int(desc.get("writer")),
        "node_ranks": _int_list(desc.get("node")),
        "world": _opt_int(desc.get("world")),
        "pids": desc.get("pids") if isinstance(desc.get("pids"), dict) else {},
        "uid": uid,
        "user": user_name(uid),
        "writer_pid": ctl.header.pid if ctl and ctl.header else None,
        "writer_alive": ctl.alive if ctl else None,
        "segments": segments,
        "segment_bytes": named,
        "bytes": named,
        "reclaimable_bytes": sum(s["bytes"] for s in segments if not s["owner_alive"]),
        "ranks": _rank_rows(desc.get("ranks")),
    }
    where = owner.directory if owner is not None else ""
    if where:  # NOTE [huge-page ring] in ``ringdir``
        job["shm_dir"] = where
        job["huge_pages"] = ringdir.describe(where).huge
    if ctl is not None and ctl.header is not None:
        job["started_unix"] = ctl.header.created_ns / 1e9
        job["age_s"] = round(max(0.0, time.time() - job["started_unix"]), 3)
    apply_counters(job, counters, ctl.size if ctl else 0)
    if ctl is not None:
        job["state"] = "closed" if counters and counters["closed"] else "live"
        if not ctl.alive:
            job["state"] = "dead"
    elif segments:
        job["state"] = "live" if any(s["owner_alive"] for s in segments) else "dead"
    if ctl is not None and ctl.alive and ctl.header is not None:
        job["bytes"] = observed_bytes(token, entries, job_pids(ctl.header, desc))
    else:  # NOTE [honest bytes]: without a live writer only names hold memory
        job["bytes"] = named
    return job


def process_uid(pid: int) -> int | None:
    """Effective uid of ``pid`` (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def job_pids(ctl: Header, desc: dict[str, Any]) -> list[int]:
    """The processes whose mappings can hold a ring's unlinked segments: its writer
    (the control segment's owner) and the ranks its description lists that run
    now, in our pid namespace, with the start time described (not a recycled pid).
    Each runs as the control segment's owner: a header or description naming
    another user's processes (a planted file) does not make their mappings
    this ring's (NOTE [whose job] in ``shmloaderd.registry``)."""
    pids = [ctl.pid] if process_uid(ctl.pid) in (None, ctl.uid) else []
    described = desc.get("pids")
    if not isinstance(described, dict):
        return pids
    mine = segment.MY_PIDNS
    for pair in list(described.values())[:4096]:
        if not (isinstance(pair, list) and len(pair) in (2, 3)):
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair):
            continue
        if len(pair) == 3 and pair[2] and mine and pair[2] != mine:
            continue  # NOTE [pid namespaces] in shmloaderd.registry
        if pair[0] in pids or process_uid(pair[0]) != ctl.uid:
            continue
        if process_alive(pair[0], pair[1]):
            pids.append(pair[0])
    return pids


def _rank_rows(value: Any) -> dict[str, dict[str, Any]]:
    """The ``ranks`` rows of a ring description, each field type-checked."""
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(value, dict):
        return out
    for rank, row in list(value.items())[:4096]:
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(row, dict)):
            continue
        role = row.get("role")
        out[rank] = {
            "role": role if role in ("leader", "node leader", "follower") else None,
            "batches": _opt_int(row.get("batches")),
            "wait_ms_p50": _opt_float(row.get("wait_ms_p50")),
            "wait_ms_p95": _opt_float(row.get("wait_ms_p95")),
            "wait_ms_p99": _opt_float(row.get("wait_ms_p99")),
            "wait_share": _opt_float(row.get("wait_share")),
            "lag": _opt_int(row.get("lag")),
            "traffic_bytes": _opt_int(row.get("traffic_bytes", row.get("bytes"))),
            "updated_unix": _opt_float(row.get("updated_unix")),
            **device_fields(row),
        }
    return out


#: What a rank with device delivery reports (``ShmLoader.stats()`` names):
#: in its ring's description (the writer) and to the daemon (every rank).
DEVICE_REPORTED = (
    "device",
    "device_batches",
    "device_bytes",
    "device_copy_ms_total",
    "device_registered",
    "device_registration_refused",
)
#: The device fields of a ``ranks`` row: what is reported, and the bandwidth.
DEVICE_KEYS = (*DEVICE_REPORTED, "device_bandwidth_gbs")


def device_fields(row: Any) -> dict[str, Any]:
    """The device fields of one reported rank row, type-checked, bandwidth derived.

    All None when the row has no device (host delivery, or no report yet).
    """
    out: dict[str, Any] = dict.fromkeys(DEVICE_KEYS)
    name = row.get("device") if isinstance(row, dict) else None
    if not isinstance(name, str) or not name:
        return out
    refused = row.get("device_registration_refused")
    registered = row.get("device_registered")
    out.update(
        device=name[:64],
        device_batches=_opt_int(row.get("device_batches")),
        device_bytes=_opt_int(row.get("device_bytes")),
        device_copy_ms_total=_opt_float(row.get("device_copy_ms_total")),
        device_registered=registered if isinstance(registered, bool) else None,
        device_registration_refused=refused[:128] if isinstance(refused, str) else None,
    )
    nbytes, ms = out["device_bytes"], out["device_copy_ms_total"]
    if nbytes is not None and ms:
        out["device_bandwidth_gbs"] = round(nbytes / ms / 1e6, 3)
    return out


def _opt_float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def mapped_bytes(pid: int, token: str) -> dict[int, int]:
    """Bytes of ring ``token``'s segments that ``pid`` maps, by inode (named or unlinked).

    From ``/proc/<pid>/maps`` (readable for our own uid); empty when unreadable.
    """
    marker = f"/{PREFIX}{token}-"  # in whichever ring directory
    out: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if marker not in line:
                    continue
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                out[inode] = max(out.get(inode, 0), hi - lo)
    except (OSError, ValueError, IndexError):
        return {}
    return out


def observed_bytes(token: str, entries: list[Entry], pids: int | list[int]) -> int:
    """Memory ring ``token`` holds as seen from outside the job: its named segments
    and the mappings of ``pids`` (its writer, and its ranks: ``job_pids``), each
    file once (NOTE [honest bytes]). What the daemon admits by; nothing a client
    declares enters it."""
    mine = [e for e in entries if e.header is not None and e.header.token == token]
    sizes = {e.inode or -i: e.size for i, e in enumerate(mine, 1)}
    for pid in [pids] if isinstance(pids, int) else pids:
        for inode, size in mapped_bytes(pid, token).items():
            sizes[inode] = max(sizes.get(inode, 0), size)
    return sum(sizes.values())


def apply_counters(job: dict[str, Any], counters: dict[str, int] | None, ctl_bytes: int) -> None:
    """Fill a job's counter fields from its control segment counters."""
    if not counters:
        return
    published = counters["published"]
    job["slots"] = counters["slots"]
    job["ring_bytes"] = counters["ring_bytes"]
    job["published"] = published
    job["bytes_published"] = counters["bytes_published"]
    job["readers"] = counters["readers"]
    if published:
        job["publish_ms_avg"] = round(counters["publish_ns_total"] / published / 1e6, 4)
    if counters["last_publish_unix_ns"]:
        job["last_publish_unix"] = counters["last_publish_unix_ns"] / 1e9


def user_name(uid: int | None) -> str | None:
    """The login name of ``uid``; its number as text when it has none; None for None."""
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def empty_job(token: str) -> dict[str, Any]:
    """A job record of the ``stat`` schema with nothing known yet."""
    return {
        "token": token,
        "job": None,
        "started_unix": None,
        "age_s": None,
        "state": "unknown",
        "registered": False,
        "group": None,
        "leader": None,
        "writer": None,
        "node_ranks": None,
        "world": None,
        "pids": {},
        "uid": None,
        "user": None,
        "writer_pid": None,
        "writer_alive": None,
        "shm_dir": None,
        "huge_pages": None,
        "segments": [],
        "segment_bytes": 0,
        "bytes": 0,
        "reclaimable_bytes": 0,
        "granted_pending_bytes": 0,
        "ended": None,
        "slots": None,
        "ring_bytes": None,
        "published": None,
        "bytes_published": None,
        "publish_ms_avg": None,
        "last_publish_unix": None,
        "readers": None,
        "ranks": {},
        "followers": {},
    }


def build_document(
    entries: list[Entry], source: str, dirs: list[str] | None = None
) -> dict[str, Any]:
    """The ``stat --json`` document (schema in the module docstring); ``dirs``:
    the ring directories scanned (``ring_dirs()`` by default)."""
    by_job: dict[tuple[str, int], list[Entry]] = {}
    invalid = []
    for e in entries:
        if e.header is None:
            invalid.append({"name": e.name, "error": e.error})
        else:  # one job per token and uid (NOTE [whose job] in ``shmloaderd.registry``)
            by_job.setdefault((e.header.token, e.header.uid), []).append(e)
    jobs = [job_from_entries(t, es) for (t, _), es in sorted(by_job.items())]
    return {
        "schema": SCHEMA,
        "source": source,
        "time_unix": time.time(),
        "node": {
            "hostname": socket.gethostname(),
            "shm_dir": segment.SHM_DIR,
            "shm_size_bytes": shm_size_bytes(),
            "shm_free_bytes": shm_free_bytes(),
            "shmloader_bytes": sum(j["bytes"] for j in jobs),
            "shm_dirs": [dir_row(d) for d in (ring_dirs() if dirs is None else dirs)],
        },
        "daemon": None,
        "jobs": jobs,
        "invalid": invalid,
        "notes": notes(jobs, source),
    }


def notes(jobs: list[dict[str, Any]], source: str) -> list[str]:
    """What a document cannot show, and why (``notes``)."""
    out = []
    missing = sorted(
        {
            int(rank)
            for j in jobs
            for rank, row in (j.get("ranks") or {}).items()
            if row.get("role") == "follower" and row.get("wait_ms_p50") is None
        }
    )
    if missing and source == "scan":
        out.append(
            "followers' waits for data (ranks "
            + ",".join(map(str, missing[:16]))
            + (",..." if len(missing) > 16 else "")
            + ") are reported only to shmloaderd: start it and set SHMLOADER_DAEMON in the "
            "job to see them; without it stat shows the writer's rows (its own wait, and each "
            "follower's batches and lag)"
        )
    return out


def scan(dirs: list[str] | None = None) -> dict[str, Any]:
    """The stat document built from segment headers alone (``source: "scan"``), of
    ``dirs`` (default: ``node_ring_dirs()``, NOTE [every ring directory]).

    Root sees every uid's jobs (``uid``/``user`` say whose); a user its own.
    """
    dirs = node_ring_dirs() if dirs is None else dirs
    return build_document(scan_entries(every_uid=os.geteuid() == 0, dirs=dirs), "scan", dirs)


# -------------------------------------------------------------------------- gc


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
    ``channel.private_dirs`` (an owner in another pid namespace counts as alive).
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


# ------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> None:
    """Add ``stat`` and ``gc`` to an ``argparse`` subparsers object.

    Each sets ``func``: ``args.func(args)`` runs it and returns the exit code.
    """
    p = subparsers.add_parser(
        "stat",
        help="show what shmloader holds in shared memory on this node",
        description="Jobs, segments, bytes and progress of shmloader on this node: per rank "
        "its role, batches, wait for data and lag. Asks shmloaderd (--daemon, "
        "SHMLOADER_DAEMON or /run/shmloader/control.sock) when reachable, else scans /dev/shm.",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print the schema-{SCHEMA} JSON document (docs/operating.md)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after N refreshes")
    p.add_argument("--daemon", default=None, metavar="PATH", help="shmloaderd control socket")
    p.set_defaults(func=cmd_stat)

    g = subparsers.add_parser(
        "gc",
        help="remove segments and sockets left by dead processes",
        description="Remove shmloader segments whose owner process is gone from every ring "
        "directory of the node (/dev/shm, SHMLOADER_SHM_DIR, the daemon's --shm-dir, "
        "/mnt/shmloader; headers validated first, live owners never touched) and stale "
        "sockets.",
    )
    g.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    g.add_argument("--json", action="store_true", help="print the list as JSON")
    g.add_argument(
        "--token",
        action="append",
        default=None,
        metavar="TOKEN",
        help="only segments and sockets of this job token (repeatable)",
    )
    g.add_argument(
        "--job",
        action="append",
        default=None,
        metavar="NAME",
        help="only the rings of this job: SHMLOADER_JOB or the launcher's run id, the JOB "
        "column of `shmloader stat` (repeatable)",
    )
    g.add_argument(
        "--owner-pid",
        action="append",
        type=int,
        default=None,
        metavar="PID",
        help="only what this (dead) process owned (repeatable)",
    )
    g.add_argument(
        "--daemon",
        default=None,
        metavar="PATH",
        help="shmloaderd control socket whose --shm-dir directories to look in too "
        "(default: SHMLOADER_DAEMON, else /run/shmloader/control.sock when it exists)",
    )
    g.set_defaults(func=cmd_gc)


def get_stats(daemon: str | None, timeout: float = 1.0) -> tuple[dict[str, Any], str]:
    """The stat document and a note saying where it came from."""
    default_socket = daemon_client.DEFAULT_SOCKET
    path = daemon_path(daemon)
    if path:
        client = daemon_client.DaemonClient(path, timeout=timeout)
        try:
            doc = client.stats()
        finally:
            client.close()
        if doc is not None:
            return doc, f"from shmloaderd at {path}"
        return scan(), f"shmloaderd at {path} did not answer; scanning the ring directories"
    return scan(), (
        f"no daemon (SHMLOADER_DAEMON unset, no {default_socket}); scanning the ring directories"
    )


def cmd_stat(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        print(f"shmloader stat: --count {args.count} must be >= 1", file=sys.stderr)
        return 2
    if args.watch is not None and not args.watch > 0:
        print(f"shmloader stat: --watch {args.watch} must be > 0 seconds", file=sys.stderr)
        return 2
    shown = 0
    try:
        while True:
            doc, note = get_stats(args.daemon)
            if args.json:
                print(
                    json.dumps(
                        doc,
                        separators=(",", ":") if args.watch else None,
                        indent=None if args.watch else 2,
                    ),
                    flush=True,
                )
                if shown == 0 and doc.get("source") == "scan":
                    print(note, file=sys.stderr)
            else:
                if args.watch is not None:
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(note)
                print(format_table(doc), flush=True)
            shown += 1
            if args.watch is None or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def cmd_gc(args: argparse.Namespace) -> int:
    items = collect_garbage(
        dry_run=args.dry_run,
        tokens=set(args.token) if args.token else None,
        owners=set(args.owner_pid) if args.owner_pid else None,
        jobs=set(args.job) if args.job else None,
        every_uid=os.geteuid() == 0,  # root: every user's leftovers (NOTE [reaping rule])
        dirs=node_ring_dirs(daemon_path(getattr(args, "daemon", None))),
    )
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    seg_bytes = 0
    for it in items:
        if it["type"] == "segment":
            seg_bytes += it["bytes"]
            print(
                f"{verb} {it['name']} ({it['kind']}, {human_bytes(it['bytes'])}, job "
                f"{it['token']}): owner pid {it['owner_pid']} is gone"
            )
        elif it["type"] == "rundir":
            print(f"{verb} runtime directory {it['name']}: pid {it['owner_pid']} is gone")
        else:
            print(f"{verb} stale socket {it['name']}: pid {it['owner_pid']} is gone")
    nseg = sum(it["type"] == "segment" for it in items)
    nsock = len(items) - nseg
    if not items and args.job:
        print(
            f"nothing to collect for job {', '.join(args.job)}: no ring of it has a dead "
            "owner (`shmloader stat` lists the jobs and their state)"
        )
    elif not items:
        print("nothing to collect: no shmloader segment or socket of a dead process")
    else:
        print(
            f"{'would free' if args.dry_run else 'freed'} {nseg} segment(s), "
            f"{human_bytes(seg_bytes)} ({seg_bytes} bytes); {nsock} stale socket(s) or "
            "runtime director(ies)"
        )
    return 0


def _ranks(ranks: list[int] | None) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def format_table(doc: dict[str, Any]) -> str:
    """The human view of a stat document."""
    node = doc["node"]
    rows = node.get("shm_dirs") or [
        {"path": node["shm_dir"], "size_bytes": node.get("shm_size_bytes"),
         "free_bytes": node.get("shm_free_bytes")}
    ]  # fmt: skip
    where = "; ".join(
        f"{r['path']} {_dash(r.get('size_bytes') and human_bytes(r['size_bytes']))} total, "
        f"{_dash(r.get('free_bytes') and human_bytes(r['free_bytes']))} free"
        for r in rows
    )  # NOTE [every ring directory]: each directory says its own room
    held = human_bytes(node["shmloader_bytes"])
    lines = [f"node {node['hostname']}: {where}; {held} held by shmloader"]
    daemon = doc.get("daemon")
    if daemon:
        budget = daemon.get("budget_bytes")
        lines.append(
            f"shmloaderd pid {daemon['pid']}: budget "
            f"{'unlimited' if budget is None else human_bytes(budget)}, "
            f"{human_bytes(daemon['in_use_bytes'])} in use, reaped "
            f"{daemon['reaped_segments']} segment(s) ({human_bytes(daemon['reaped_bytes'])})"
        )
    jobs = doc["jobs"]
    others = doc.get("others")
    if others:  # a user's view of a node-mode daemon: the rest of the node as totals
        left = (daemon or {}).get("budget_left_bytes")
        lines.append(
            f"other users: {others['jobs']} job(s), {human_bytes(others['bytes'])} held"
            + ("" if left is None else f"; node budget left {human_bytes(left)}")
        )
    if daemon:
        for uid, row in (daemon.get("uids") or {}).items():
            if row.get("budget_bytes") is not None:
                lines.append(
                    f"uid {uid} ({row['user']}): {human_bytes(row['bytes'])} of its budget "
                    f"{human_bytes(row['budget_bytes'])} in use"
                )
    uids = {j.get("uid") for j in jobs} - {None}
    show_user = bool((daemon or {}).get("tenants") or len(uids) > 1 or uids - {os.geteuid()})
    if not jobs:
        lines.append("no shmloader jobs on this node")
    else:
        header = ("USER       " if show_user else "") + (
            f"{'TOKEN':<16} {'JOB':<14} {'STATE':<7} {'AGE':>7} {'GROUP':<10} {'WRITER PID':>10} "
            f"{'SEGS':>4} {'HELD':>10} {'SLOTS':>5} {'BATCHES':>8} {'PUB MS':>7}"
        )
        lines.append(header)
        for j in jobs:
            pid = j.get("writer_pid")
            alive = j.get("writer_alive")
            pid_text = "-" if pid is None else f"{pid}{'' if alive else '†'}"
            name = j.get("job") or "-"
            name = name if len(name) <= 14 else name[:13] + "…"
            who = j.get("user") or _dash(j.get("uid"))
            lines.append(
                (f"{who[:10]:<10} " if show_user else "")
                + f"{j['token']:<16} {name:<14} {j['state']:<7} {_age(j.get('age_s')):>7} "
                f"{_ranks(j['group']):<10} {pid_text:>10} {len(j['segments']):>4} "
                f"{human_bytes(j['bytes']):>10} {_dash(j['slots']):>5} "
                f"{_dash(j['published']):>8} {_dash(j['publish_ms_avg'], '{:.2f}'):>7}"
            )
            ended = j.get("ended")
            if ended:
                ago = max(0.0, doc.get("time_unix", time.time()) - ended["unix"])
                lines.append(
                    f"    dead since {time.strftime('%H:%M:%S', time.localtime(ended['unix']))} "
                    f"({_age(ago)} ago): {ended['why']}; shmloaderd reaped "
                    f"{ended['reaped_segments']} segment(s), {human_bytes(ended['reaped_bytes'])}"
                )
            elif j["state"] == "dead" and j.get("reclaimable_bytes"):
                lines.append(
                    f"    dead: `shmloader gc` frees {human_bytes(j['reclaimable_bytes'])}"
                )
            ring_dir = j.get("shm_dir")  # None: not known (a dead job's record, nothing named)
            if ring_dir and (j.get("huge_pages") or len(rows) > 1 or ring_dir != ringdir.DEFAULT):
                pages = "2 MiB pages" if j.get("huge_pages") else "4 KiB pages"
                lines.append(f"    ring in {ring_dir}: {pages}")
            if j.get("granted_pending_bytes"):
                lines.append(
                    f"    admitted, not in {ring_dir or 'its ring directory'} yet: "
                    f"{human_bytes(j['granted_pending_bytes'])} (counted against the budget)"
                )
            rows = _merged_ranks(j)
            if rows:
                lines.append(
                    f"    {'RANK':>6} {'ROLE':<11} {'BATCHES':>8} {'WAIT P50':>9} {'P95':>9} "
                    f"{'P99':>9} {'WAITING':>8} {'LAG':>4} {'TRAFFIC':>10}"
                )
            for rank, r in rows:
                waits = " ".join(f"{_ms(r.get(f'wait_ms_{p}')):>9}" for p in ("p50", "p95", "p99"))
                traffic = r.get("traffic_bytes")
                lines.append(
                    f"    {rank:>6} {r.get('role') or '-':<11} {_dash(r.get('batches')):>8} "
                    f"{waits} {_pct(r.get('wait_share')):>8} {_dash(r.get('lag')):>4} "
                    f"{_dash(traffic and human_bytes(traffic)):>10}"
                )
                if r.get("device"):
                    lines.append(f"{'':>11}{_device_line(r)}")
    for bad in doc.get("invalid", []):
        lines.append(f"ignored {bad['name']}: {bad['error']}")
    if any(j.get("writer_alive") is False for j in jobs):
        lines.append("† writer process is gone: `shmloader gc` (or shmloaderd) frees its segments")
    if any(_merged_ranks(j) for j in jobs):
        lines.append(
            "HELD: bytes the job holds in its ring directory now. WAIT P50/P95/P99: wait for "
            "a batch over recent batches. WAITING: share of wall time spent waiting since the "
            "first batch (high on the leader: the input pipeline is the bottleneck). TRAFFIC: "
            "payload bytes "
            "published or received so far, not memory"
        )
    for row in node.get("shm_dirs") or []:  # NOTE [huge-page ring] in ``ringdir``
        pages = "2 MiB pages" if row.get("huge") else "4 KiB pages"
        free = row.get("free_bytes")
        lines.append(
            f"ring dir {row['path']}: {row.get('fs') or '?'} huge={row.get('huge_option')} "
            f"mode {row.get('mode')}, {_dash(free and human_bytes(free))} free: {pages}"
        )
    lines += [f"note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _device_line(row: dict[str, Any]) -> str:
    """A rank's device delivery in one line: bytes, copy time, bandwidth, registration."""
    nbytes, ms, gbs = (
        row.get("device_bytes"),
        row.get("device_copy_ms_total"),
        row["device_bandwidth_gbs"],
    )
    copied = "-" if nbytes is None else human_bytes(nbytes)
    took = "-" if ms is None else f"{ms:.2f} ms"
    rate = "-" if gbs is None else f"{gbs:.2f} GB/s"
    if row.get("device_registered"):
        ring = "ring registered"
    elif row.get("device_registration_refused"):
        ring = f"ring NOT registered ({row['device_registration_refused']})"
    else:
        ring = "ring not registered"
    return f"{row['device']}: copied {copied} in {took} ({rate}), {ring}"


def _merged_ranks(job: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Per-rank rows: ``ranks``, completed from the older ``followers`` rows."""
    rows = {r: dict(v) for r, v in (job.get("ranks") or {}).items()}
    for rank, f in (job.get("followers") or {}).items():
        row = rows.setdefault(rank, {"role": "follower"})
        if row.get("batches") is None:
            row["batches"] = f.get("consumed")
        if row.get("lag") is None:
            row["lag"] = f.get("lag")
    return sorted(rows.items(), key=lambda kv: int(kv[0]))
