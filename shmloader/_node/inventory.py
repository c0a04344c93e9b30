"""The node inventory: what shmloader holds in this node's ring directories, and whose it is.

Owns reading segment headers and ring descriptions into the ``stat``
document (``scan``: jobs, ranks, bytes, ``source: "scan"``; its schema is
drawn in docs/internals/stat-document.md), the directories scanned and each
job's processes and mapped bytes. It only reads: removing is ``gc``'s, the
table and the command line are ``shmloader.tools.stat``'s.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError
from . import ringdir, segment
from .ring import COUNTER_FIELDS
from .segment import (
    ANY_UID,
    HEADER_SIZE,
    KIND_CONTROL,
    PREFIX,
    Header,
    list_segments,
    owner_alive,
    process_alive,
    shm_free_bytes,
    shm_path,
    shm_size_bytes,
    validate,
)

SCHEMA = 3
_COUNTERS = struct.Struct("<" + "Q" * len(COUNTER_FIELDS))
_COUNTERS_AT = 64
_DESCR_LEN = struct.Struct("<I")


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
    declares enters it.

    NOTE [honest bytes]
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
    """
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


def node_ring_dirs(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every ring directory this node's jobs may use: ``ring_dirs`` plus ``extra`` (a
    daemon's ``--shm-dir`` list, ``shmloader.tools.stat.daemon_ring_dirs``) and the
    systemd mount's directory.

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
    """
    return ring_dirs([*extra, ringdir.SYSTEMD_RING_DIR])
