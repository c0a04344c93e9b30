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

``stat --json`` document, schema 1 (fields are only ever added)::

    {
      "schema": 1,
      "source": "daemon" | "scan",     # who built it
      "time_unix": float,
      "node": {"hostname": str, "shm_dir": "/dev/shm",
               "shm_size_bytes": int|null, "shm_free_bytes": int|null,
               "shmloader_bytes": int},  # sum of "bytes" of all jobs
      "daemon": null | {"pid": int, "version": str, "socket": str,
               "budget_bytes": int|null, "in_use_bytes": int, "uptime_s": float,
               "reaped_segments": int, "reaped_bytes": int,
               "pool_bytes": int, "pool_segments": int},
      "jobs": [                         # one per ring: an SP group on this node
        {"token": str,
         "state": "live" | "dead" | "closed" | "unknown",
         "registered": bool,            # told to the daemon (false in a scan)
         "group": [int]|null, "leader": int|null, "writer": int|null,
         "node_ranks": [int]|null, "world": int|null,
         "pids": {"<rank>": [pid, start]},
         "writer_pid": int|null, "writer_alive": bool|null,
         "segments": [{"name": str, "kind": "control"|"data"|"probe",
                       "bytes": int, "owner_pid": int, "owner_alive": bool}],
         "segment_bytes": int,          # named in /dev/shm now
         "bytes": int,                  # memory held: max(named, ring counters)
         "slots": int|null, "ring_bytes": int|null,
         "published": int|null,         # batches written by the writer
         "bytes_published": int|null,
         "publish_ms_avg": float|null,
         "last_publish_unix": float|null,
         "readers": int|null,
         "followers": {"<rank>": {"consumed": int|null, "lag": int|null,
                                  "receive_ms": float|null, "updated_unix": float}}}
      ],
      "invalid": [{"name": str, "error": str}]   # shml-* entries we refuse to touch
    }
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError, human_bytes
from .ring import COUNTER_FIELDS
from .segment import (
    HEADER_SIZE,
    KIND_CONTROL,
    PREFIX,
    SHM_DIR,
    Header,
    list_segments,
    owner_alive,
    proc_start_time,
    shm_free_bytes,
    shm_path,
    shm_size_bytes,
    unlink_name,
    validate,
)

SCHEMA = 1
_COUNTERS = struct.Struct("<" + "Q" * len(COUNTER_FIELDS))
_COUNTERS_AT = 64
_DESCR_LEN = struct.Struct("<I")
_SOCKET_NAME = re.compile(r"^(?P<token>[0-9A-Za-z]{1,64})-(?P<pid>[0-9]{1,10})\.sock$")


# ------------------------------------------------------------------ inspection


@dataclass
class Entry:
    """One ``shml-*`` name in /dev/shm: validated (``header``) or not (``error``)."""

    name: str
    header: Header | None = None
    error: str = ""
    size: int = 0
    counters: dict[str, int] | None = None
    description: dict[str, Any] | None = None
    alive: bool = False

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


def inspect(name: str) -> Entry | None:
    """Validate one segment by name (NOTE [reaping rule]); None if it vanished."""
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
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{name} is not a regular file")
        header = validate(fd, name, kind=None, token=None)
        if not name.startswith(f"/{PREFIX}{header.token}-"):
            raise ProtocolError(f"{name} carries token {header.token!r}, not the one in its name")
        entry.size = st.st_size
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
    raw_len = os.pread(fd, _DESCR_LEN.size, HEADER_SIZE)
    if len(raw_len) == _DESCR_LEN.size:
        (length,) = _DESCR_LEN.unpack(raw_len)
        if 0 < length <= header.capacity - _DESCR_LEN.size:
            try:
                parsed = json.loads(os.pread(fd, length, HEADER_SIZE + _DESCR_LEN.size))
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                description = parsed
    return counters, description


def scan_entries() -> list[Entry]:
    """Every ``shml-*`` entry of /dev/shm, validated."""
    return [e for name in list_segments() if (e := inspect(name)) is not None]


def remove_if_dead(name: str, *, dry_run: bool = False) -> Freed | None:
    """Re-validate ``name`` and unlink it if its owner is dead (NOTE [reaping rule])."""
    entry = inspect(name)
    if entry is None or entry.header is None or entry.alive:
        return None
    h = entry.header
    freed = Freed(
        "segment",
        name,
        entry.size,
        h.kind_name,
        h.token,
        h.pid,
        extra={"owner_start": h.start},
    )
    if not dry_run:
        freed.removed = unlink_name(name)
    return freed


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
    segments = [
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
    job: dict[str, Any] = {
        **empty_job(token),
        "group": _int_list(desc.get("group")),
        "leader": _opt_int(desc.get("leader")),
        "writer": _opt_int(desc.get("writer")),
        "node_ranks": _int_list(desc.get("node")),
        "world": _opt_int(desc.get("world")),
        "pids": desc.get("pids") if isinstance(desc.get("pids"), dict) else {},
        "writer_pid": ctl.header.pid if ctl and ctl.header else None,
        "writer_alive": ctl.alive if ctl else None,
        "segments": segments,
        "segment_bytes": named,
        "bytes": named,
    }
    apply_counters(job, counters, ctl.size if ctl else 0)
    if ctl is not None:
        job["state"] = "closed" if counters and counters["closed"] else "live"
        if not ctl.alive:
            job["state"] = "dead"
    elif segments:
        job["state"] = "live" if any(s["owner_alive"] for s in segments) else "dead"
    return job


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
    held = counters["ring_bytes"] + counters["slots"] * HEADER_SIZE + ctl_bytes
    job["bytes"] = max(job["segment_bytes"], held)


def empty_job(token: str) -> dict[str, Any]:
    """A job record of the ``stat`` schema with nothing known yet."""
    return {
        "token": token,
        "state": "unknown",
        "registered": False,
        "group": None,
        "leader": None,
        "writer": None,
        "node_ranks": None,
        "world": None,
        "pids": {},
        "writer_pid": None,
        "writer_alive": None,
        "segments": [],
        "segment_bytes": 0,
        "bytes": 0,
        "slots": None,
        "ring_bytes": None,
        "published": None,
        "bytes_published": None,
        "publish_ms_avg": None,
        "last_publish_unix": None,
        "readers": None,
        "followers": {},
    }


def build_document(entries: list[Entry], source: str) -> dict[str, Any]:
    """The ``stat --json`` document (schema in the module docstring)."""
    by_token: dict[str, list[Entry]] = {}
    invalid = []
    for e in entries:
        if e.header is None:
            invalid.append({"name": e.name, "error": e.error})
        else:
            by_token.setdefault(e.header.token, []).append(e)
    jobs = [job_from_entries(t, es) for t, es in sorted(by_token.items())]
    return {
        "schema": SCHEMA,
        "source": source,
        "time_unix": time.time(),
        "node": {
            "hostname": socket.gethostname(),
            "shm_dir": SHM_DIR,
            "shm_size_bytes": shm_size_bytes(),
            "shm_free_bytes": shm_free_bytes(),
            "shmloader_bytes": sum(j["bytes"] for j in jobs),
        },
        "daemon": None,
        "jobs": jobs,
        "invalid": invalid,
    }


def scan() -> dict[str, Any]:
    """The stat document built from /dev/shm headers alone (``source: "scan"``)."""
    return build_document(scan_entries(), "scan")


# -------------------------------------------------------------------------- gc


def _runtime_base(runtime_dir: str | None) -> str:
    base = (
        runtime_dir
        or os.environ.get("SHMLOADER_RUNTIME_DIR")
        or os.environ.get("XDG_RUNTIME_DIR")
        or "/tmp"
    )
    return os.path.join(base, f"shmloader-{os.geteuid()}")


def stale_sockets(runtime_dir: str | None = None) -> list[str]:
    """Socket files ``<token>-<pid>.sock`` of ours whose pid is not running."""
    path = _runtime_base(runtime_dir)
    try:
        st = os.lstat(path)
        names = os.listdir(path)
    except OSError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return []
    out = []
    for name in sorted(names):
        m = _SOCKET_NAME.match(name)
        if m is None:
            continue
        full = os.path.join(path, name)
        try:
            fst = os.lstat(full)
        except OSError:
            continue
        ours = stat.S_ISSOCK(fst.st_mode) and fst.st_uid == os.geteuid()
        if ours and proc_start_time(int(m["pid"])) is None:
            out.append(full)
    return out


def collect_garbage(
    dry_run: bool = False,
    runtime_dir: str | None = None,
    *,
    tokens: set[str] | None = None,
    owners: set[int] | None = None,
) -> list[dict[str, Any]]:
    """Remove (or with ``dry_run`` only list) what dead owners left: segments, sockets, dirs.

    ``tokens`` and ``owners`` (pids) narrow it to those jobs or processes
    (the test suite scopes its gc so that it never touches other runs).
    Returns one dict per item: ``type`` ("segment"|"socket"|"rundir"),
    ``name``, ``bytes``, ``kind``, ``token``, ``owner_pid``, ``removed``.
    """
    from .reap import remove_runtime_dir, runtime_dirs

    out: list[dict[str, Any]] = []
    for entry in scan_entries():
        h = entry.header
        if h is None or entry.alive:
            continue
        if (tokens is not None and h.token not in tokens) or (
            owners is not None and h.pid not in owners
        ):
            continue
        freed = remove_if_dead(entry.name, dry_run=dry_run)
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
    for path, pid, alive in runtime_dirs(runtime_dir):
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
        description="Jobs, segments, bytes and progress of shmloader on this node. Asks "
        "shmloaderd (--daemon or SHMLOADER_DAEMON) when reachable, else scans /dev/shm.",
    )
    p.add_argument("--json", action="store_true", help="print the schema-1 JSON document")
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
        description="Remove shmloader segments in /dev/shm whose owner process is gone "
        "(header validated first; live owners are never touched) and stale sockets.",
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
        "--owner-pid",
        action="append",
        type=int,
        default=None,
        metavar="PID",
        help="only what this (dead) process owned (repeatable)",
    )
    g.set_defaults(func=cmd_gc)


def get_stats(daemon: str | None, timeout: float = 1.0) -> tuple[dict[str, Any], str]:
    """The stat document and a note saying where it came from."""
    path = daemon or os.environ.get("SHMLOADER_DAEMON") or None
    if path:
        from .daemon_client import DaemonClient

        client = DaemonClient(path, timeout=timeout)
        try:
            doc = client.stats()
        finally:
            client.close()
        if doc is not None:
            return doc, f"from shmloaderd at {path}"
        return scan(), f"shmloaderd at {path} did not answer; scanning /dev/shm headers instead"
    return scan(), "no daemon (SHMLOADER_DAEMON unset); scanning /dev/shm headers"


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
    if not items:
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


def format_table(doc: dict[str, Any]) -> str:
    """The human view of a stat document."""
    node = doc["node"]
    size, free = node.get("shm_size_bytes"), node.get("shm_free_bytes")
    lines = [
        f"node {node['hostname']}: {node['shm_dir']} "
        f"{_dash(size and human_bytes(size))} total, {_dash(free and human_bytes(free))} free, "
        f"{human_bytes(node['shmloader_bytes'])} held by shmloader"
    ]
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
    if not jobs:
        lines.append("no shmloader jobs on this node")
    else:
        header = (
            f"{'TOKEN':<16} {'STATE':<7} {'GROUP':<10} {'LEADER':>6} {'WRITER PID':>10} "
            f"{'SEGS':>4} {'BYTES':>10} {'SLOTS':>5} {'BATCHES':>8} {'PUB MS':>7} {'READERS':>7}"
        )
        lines.append(header)
        for j in jobs:
            pid = j.get("writer_pid")
            alive = j.get("writer_alive")
            pid_text = "-" if pid is None else f"{pid}{'' if alive else '†'}"
            lines.append(
                f"{j['token']:<16} {j['state']:<7} {_ranks(j['group']):<10} "
                f"{_dash(j['leader']):>6} {pid_text:>10} {len(j['segments']):>4} "
                f"{human_bytes(j['bytes']):>10} {_dash(j['slots']):>5} "
                f"{_dash(j['published']):>8} {_dash(j['publish_ms_avg'], '{:.2f}'):>7} "
                f"{_dash(j['readers']):>7}"
            )
            for rank, f in sorted(j.get("followers", {}).items(), key=lambda kv: int(kv[0])):
                lines.append(
                    f"    rank {rank}: consumed {_dash(f.get('consumed'))}, lag "
                    f"{_dash(f.get('lag'))}, receive {_dash(f.get('receive_ms'), '{:.3f}')} ms"
                )
    for bad in doc.get("invalid", []):
        lines.append(f"ignored {bad['name']}: {bad['error']}")
    if any(j.get("writer_alive") is False for j in jobs):
        lines.append("† writer process is gone: `shmloader gc` (or shmloaderd) frees its segments")
    return "\n".join(lines)
