"""``shmloader stat`` and ``shmloader gc``: the command line and the table.

Owns argparse, where the document comes from (the daemon or a scan,
``get_stats``), the daemon's extra ring directories, and the table
(``format_table``). Reads ``shmloader._node.inventory``'s document and calls
``shmloader._node.reaping``; training code never imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .._node import ringdir
from .._node.inventory import SCHEMA, node_ring_dirs, scan, scan_entries
from .._node.reaping import collect_garbage
from .._node.segment import KIND_CONTROL
from .._transport import daemon_client
from ..config import daemon_socket, well_known_socket
from ..errors import human_bytes


def daemon_ring_dirs(daemon: str | None = None, timeout: float = 1.0) -> list[str]:
    """``inventory.node_ring_dirs`` with the daemon's ``--shm-dir`` list (from its
    ``hello``, when ``daemon`` names a socket that answers; NOTE [every ring directory])."""
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
    return node_ring_dirs(extra)


def daemon_path(daemon: str | None = None) -> str | None:
    """The daemon socket ``stat``/``gc`` ask: ``--daemon``, else the one a job asks
    (``SHMLOADER_DAEMON``, none for ``off``, else the well-known socket when it
    exists: NOTE [finding the daemon] in ``config``)."""
    if daemon:
        return daemon
    path = daemon_socket()
    if path is not None and path == well_known_socket() and not os.path.exists(path):
        return None
    return path


def register(subparsers: Any) -> None:
    """Add ``stat`` and ``gc`` to an ``argparse`` subparsers object.

    Each sets ``func``: ``args.func(args)`` runs it and returns the exit code.
    """
    p = subparsers.add_parser(
        "stat",
        help="show what shmloader holds in shared memory on this node",
        description="Jobs, segments, bytes and progress of shmloader on this node: per rank "
        "its role, batches, wait for data and lag. Asks shmloaderd (--daemon, "
        "SHMLOADER_DAEMON or /run/shmloader/control.sock) when reachable, else scans /dev/shm. "
        "SLOTS is how many slots (a batch's buffer each) the ring has now, the pool its "
        "DataLoader workers write into included (up to prefetch_factor + ceil((SHMLOADER_SLOTS + "
        "2) / num_workers) + 1 per worker): not the SHMLOADER_SLOTS setting, which bounds how "
        "many batches the leader runs ahead of its slowest follower.",
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
        "sockets. Reports one line per job: its name (the JOB column of `shmloader stat`), "
        "ring token, segments, bytes and dead owner pids; --verbose adds each segment.",
    )
    g.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    g.add_argument("--json", action="store_true", help="print the list as JSON")
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="list every segment under its job (by default one line per job)",
    )
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
    """The stat document and a note saying where it came from.

        ``--daemon PATH``, else ``SHMLOADER_DAEMON``, else the system daemon's
    default socket (``/run/shmloader/control.sock``) when it exists; if none
    answers, a scan of /dev/shm. The writer of each ring rewrites the ring's
    description once a second with per-rank rows, so a scan shows progress
    and the leader's wait for data too; only the daemon knows followers'
    own wait times (they report to it). The same holds for device delivery:
    the writer's row carries its own ``device*`` fields; a follower's come
    with its reports to the daemon.
    """
    default_socket = well_known_socket()
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
        "no daemon ("
        + (
            "SHMLOADER_DAEMON=off"
            if daemon_socket() is None
            else f"SHMLOADER_DAEMON unset, no {default_socket}"
        )
        + "); scanning the ring directories"
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


def job_names(dirs: list[str], every_uid: bool) -> dict[str, str]:
    """Ring token -> job name (``SHMLOADER_JOB`` or the launcher's run id, the ``JOB``
    column of ``stat``) of every ring whose control segment names one."""
    names: dict[str, str] = {}
    for e in scan_entries(every_uid=every_uid, dirs=dirs):
        name = (e.description or {}).get("job")
        if e.header is not None and e.header.kind == KIND_CONTROL and isinstance(name, str):
            names[e.header.token] = name
    return names


def _pids(pids: list[int]) -> str:
    """``owner pid 7 is gone`` or ``owner pids 7, 9 are gone``."""
    if len(pids) == 1:
        return f"owner pid {pids[0]} is gone"
    return f"owner pids {', '.join(map(str, pids))} are gone"


def gc_lines(items: list[dict[str, Any]], dry_run: bool, verbose: bool = False) -> list[str]:
    """``gc``'s human report: one line per job (its name, ring token, segments, bytes and
    dead owners; with ``verbose`` each segment beneath it), one per socket or directory."""
    verb = "would remove" if dry_run else "removed"
    rings: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        if it["type"] == "segment":
            rings.setdefault(it["token"], []).append(it)
    lines = []
    for token, segs in rings.items():
        name = segs[0].get("job")
        what = f"job {name} (ring {token})" if name else f"ring {token} (no job name)"
        pids = sorted({it["owner_pid"] for it in segs})
        size = human_bytes(sum(it["bytes"] for it in segs))
        lines.append(f"{verb} {what}: {len(segs)} segment(s), {size}; {_pids(pids)}")
        if verbose:
            lines += [
                f"    {verb} {it['name']} ({it['kind']}, {human_bytes(it['bytes'])}): "
                f"{_pids([it['owner_pid']])}"
                for it in segs
            ]
    for it in items:
        if it["type"] == "rundir":
            lines.append(f"{verb} runtime directory {it['name']}: {_pids([it['owner_pid']])}")
        elif it["type"] == "socket":
            lines.append(f"{verb} stale socket {it['name']}: {_pids([it['owner_pid']])}")
    return lines


def cmd_gc(args: argparse.Namespace) -> int:
    every_uid = os.geteuid() == 0  # root: every user's leftovers (NOTE [reaping rule])
    dirs = daemon_ring_dirs(daemon_path(getattr(args, "daemon", None)))
    names = job_names(dirs, every_uid)  # before the control segments go
    items = collect_garbage(
        dry_run=args.dry_run,
        tokens=set(args.token) if args.token else None,
        owners=set(args.owner_pid) if args.owner_pid else None,
        jobs=set(args.job) if args.job else None,
        every_uid=every_uid,
        dirs=dirs,
    )
    for it in items:
        it["job"] = names.get(it["token"]) if it.get("token") else None
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    for line in gc_lines(items, args.dry_run, getattr(args, "verbose", False)):
        print(line)
    nseg = sum(it["type"] == "segment" for it in items)
    njobs = len({it["token"] for it in items if it["type"] == "segment"})
    seg_bytes = sum(it["bytes"] for it in items if it["type"] == "segment")
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
            f"{'would free' if args.dry_run else 'freed'} {nseg} segment(s) of {njobs} job(s), "
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
                over = row.get("over_budget_bytes") if row.get("over_budget") else None
                lines.append(
                    f"uid {uid} ({row['user']}): {human_bytes(row['bytes'])} of its budget "
                    f"{human_bytes(row['budget_bytes'])} in use"
                    + ("" if over is None else f": OVER BUDGET by {human_bytes(over)}")
                )
            last = row.get("last_refusal")
            if last:  # NOTE [budget] in ``shmloaderd.registry``: the last refusal, and why
                when = time.strftime("%H:%M:%S", time.localtime(last["unix"]))
                lines.append(f"    last refusal ({last['reason']}) at {when}: {last['message']}")
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
            if j.get("over_budget"):  # NOTE [over budget] in ``shmloaderd.document``
                lines.append(
                    f"    OVER BUDGET: uid {_dash(j.get('uid'))} holds more than its budget"
                    + (
                        ""
                        if j.get("registered")
                        else " (this job is not registered with shmloaderd: it runs "
                        "embedded, its memory was never admitted)"
                    )
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
