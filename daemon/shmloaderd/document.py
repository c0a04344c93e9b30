"""What the daemon adds to the node inventory's stats document, and its accounts per uid.

It owns the job records the registry completes (``add_registry``: registration,
pids, pending grants, each rank's report row and follower record; the ended jobs
``stat`` still shows, NOTE [dead jobs stay visible]), each reporting rank's wait
histogram for the metrics (``waits``), and ``UidAccounts``: per uid, the bytes its
jobs hold against its budget, what was reaped of it, its admissions, refusals and
connections, and the jobs over their uid's budget, marked and logged (NOTE [over
budget]). ``server`` assembles the document and each asker's view of it. It reads
the registry, the budgets and the connection guard it is given, and imports the
node inventory, ``registry``, ``tenants``, ``guard`` and ``errors``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shmloader._node.inventory import DEVICE_KEYS, device_fields, empty_job
from shmloader.errors import human_bytes

from .guard import ConnectionGuard
from .registry import Registry
from .tenants import UidBudgets, user_name

log = logging.getLogger("shmloaderd")

RANK_KEYS = (
    "role", "batches", "wait_ms_p50", "wait_ms_p95", "wait_ms_p99", "wait_share", "lag",
    "traffic_bytes", "updated_unix", *DEVICE_KEYS,
)  # fmt: skip
#: What a rank's report sets in its ``stat`` row, as (report field, row field).
ROW_FROM_REPORT = (
    ("role", "role"), ("wait_ms_p50", "wait_ms_p50"), ("wait_ms_p95", "wait_ms_p95"),
    ("wait_ms_p99", "wait_ms_p99"), ("wait_share", "wait_share"), ("lag", "lag"),
    ("bytes", "traffic_bytes"),
)  # fmt: skip


def add_registry(doc: dict[str, Any], registry: Registry, now: float) -> None:
    """Each job of ``registry`` into ``doc["jobs"]`` (the inventory's records, by uid
    and token: NOTE [whose job]): its registration, pids, pending grants and each
    rank's report; then the ended jobs it still shows (NOTE [dead jobs stay
    visible]), and the jobs sorted by token."""
    jobs = {(j["uid"], j["token"]): j for j in doc["jobs"]}  # NOTE [whose job]
    for key, job in registry.jobs.items():
        token = job.token
        j = jobs.get(key)
        if j is None:
            j = jobs[key] = empty_job(token)
            alive = job.alive()
            j["state"] = "live" if alive else "unknown" if alive is None else "dead"
        j["registered"] = job.registered
        if job.uid is not None:
            j["uid"], j["user"] = job.uid, user_name(job.uid)
        if job.name is not None:
            j["job"] = job.name
        if j["started_unix"] is None:
            j["started_unix"] = job.since
            j["age_s"] = round(max(0.0, time.time() - job.since), 3)
        for name, attr in (
            ("group", "group"),
            ("node_ranks", "node"),
            ("leader", "leader"),
            ("writer", "writer"),
            ("world", "world"),
        ):
            if getattr(job, attr) is not None:
                j[name] = getattr(job, attr)
        if job.pids:
            j["pids"] = {str(r): list(p) for r, p in sorted(job.pids.items())}
        # NOTE [honest bytes]: ``bytes`` is /dev/shm's; grants are reserved apart
        j["granted_pending_bytes"] = job.pending(now)
        ranks = j["ranks"]
        for rank, rep in sorted(job.reports.items()):
            row = ranks.setdefault(str(rank), dict.fromkeys(RANK_KEYS))
            writes = rep.get("role") in ("leader", "node leader") or "consumed" not in rep
            row["batches"] = rep.get("published") if writes else rep["consumed"]
            for source, field in ROW_FROM_REPORT:
                if rep.get(source) is not None:
                    row[field] = rep[source]
            if rep.get("device") is not None:  # the rank's own, newer than the writer's
                row.update(device_fields(rep))
            row["updated_unix"] = rep["updated_unix"]
            if row["lag"] is None and rep.get("consumed") is not None:
                published = rep.get("published", j.get("published"))
                if published is not None:
                    row["lag"] = max(published - rep["consumed"], 0)
        followers = {}
        for rank, rep in sorted(job.reports.items()):
            f = {
                "consumed": rep.get("consumed"),
                "lag": rep.get("lag"),
                "receive_ms": rep.get("receive_ms"),
                "updated_unix": rep["updated_unix"],
            }
            if f["lag"] is None and f["consumed"] is not None:
                published = rep.get("published", j.get("published"))
                if published is not None:
                    f["lag"] = max(published - f["consumed"], 0)
            followers[str(rank)] = f
        j["followers"] = followers
    registry.forget_ended()
    for key, rec in registry.ended.items():
        if key not in jobs:
            jobs[key] = ended_job(rec)
    doc["jobs"] = [jobs[k] for k in sorted(jobs, key=by_token)]


def ended_job(rec: Any) -> dict[str, Any]:
    """The ``stat`` record of a dead job the daemon reaped (NOTE [dead jobs stay visible])."""
    job = rec.job
    j = empty_job(job.token)
    j.update(
        state="dead",
        registered=job.registered,
        job=job.name,
        started_unix=job.since,
        group=job.group,
        leader=job.leader,
        writer=job.writer,
        node_ranks=job.node,
        world=job.world,
        pids={str(r): list(p) for r, p in sorted(job.pids.items())},
        writer_alive=False,
        uid=job.uid,
        user=None if job.uid is None else user_name(job.uid),
        ended={
            "unix": rec.unix,
            "why": rec.why,
            "reaped_segments": rec.reaped_segments,
            "reaped_bytes": rec.reaped_bytes,
        },
    )
    return j


def by_token(key: tuple[Any, str]) -> tuple[str, int]:
    """Jobs in the document: by token, then uid (NOTE [whose job])."""
    return (key[1], -1 if key[0] is None else key[0])


def waits(registry: Registry) -> list[dict[str, Any]]:
    """Each reporting rank's wait histogram since its first batch (for metrics)."""
    out = []
    for job in registry.jobs.values():
        token = job.token
        for rank, rep in job.reports.items():
            if rep.get("wait_hist") is not None:
                out.append({
                    "token": token, "job": job.name or "", "rank": str(rank),
                    "uid": "" if job.uid is None else str(job.uid),
                    "role": rep.get("role") or "", "counts": list(rep["wait_hist"]),
                    "sum_ms": rep.get("wait_ms_sum") or 0.0,
                })  # fmt: skip
    return out


class UidAccounts:
    """Per uid: what its jobs hold against its budget, what was reaped of it, its
    admissions and refusals, and which of its jobs are over its budget (NOTE [over
    budget]). The daemon's loop thread alone uses it (reap passes, requests).
    """

    def __init__(self, registry: Registry, budgets: UidBudgets) -> None:
        self.registry = registry
        self.budgets = budgets
        self.reaped: dict[int, list[int]] = {}  # uid -> [segments, bytes]
        self.over_budget: dict[tuple[int, str], str] = {}  # NOTE [over budget]: key -> job

    def note_reaped(self, uid: int, nbytes: int) -> None:
        """A segment of ``nbytes`` of uid ``uid`` was reaped."""
        count = self.reaped.setdefault(uid, [0, 0])
        count[0] += 1
        count[1] += nbytes

    def rows(
        self, jobs: list[dict[str, Any]], now: float, guard: ConnectionGuard | None
    ) -> dict[str, Any]:
        """Per uid: its jobs, bytes held, budget and what is left of it, bytes reaped."""
        uids = {j["uid"] for j in jobs if j.get("uid") is not None} | set(self.reaped)
        uids |= {uid for uid, _ in self.registry.admissions if uid >= 0}
        uids |= {uid for uid, _ in self.registry.refusals if uid >= 0}
        uids |= set(self.budgets.per_uid)
        uids |= set(guard.counts() if guard is not None else ())
        return {str(uid): self.row(uid, jobs, now, guard) for uid in sorted(uids)}

    def row(
        self, uid: int, jobs: list[dict[str, Any]], now: float, guard: ConnectionGuard | None
    ) -> dict[str, Any]:
        """Uid ``uid``'s row: its jobs (``jobs`` of the document), bytes, budget, reaps,
        admissions and refusals, over budget or not, connections."""
        budget = self.budgets(uid)
        held = self.registry.uid_in_use(uid, now)
        mine = [j for j in jobs if j.get("uid") == uid]
        held = max(held, sum(j["bytes"] for j in mine if j["state"] != "dead"))
        reaped = self.reaped.get(uid, [0, 0])
        return {
            "user": user_name(uid),
            "jobs": len(mine),
            "bytes": held,
            "budget_bytes": budget,
            "budget_left_bytes": left(budget, held),
            "reaped_segments": reaped[0],
            "reaped_bytes": reaped[1],
            "admissions_granted": self.registry.admissions.get((uid, "granted"), 0),
            "admissions_refused": self.registry.admissions.get((uid, "refused"), 0),
            # NOTE [over budget]; NOTE [budget] in ``registry``: every refusal, by reason
            "over_budget": budget is not None and held > budget,
            "over_budget_bytes": 0 if budget is None else max(held - budget, 0),
            "refusals": {
                code: n for (u, code), n in sorted(self.registry.refusals.items()) if u == uid
            },
            "last_refusal": self.registry.last_refusal.get(uid),
            # NOTE [connection bound] in ``guard``: its connections to the socket now
            "connections": 0 if guard is None else guard.counts().get(uid, 0),
        }

    # NOTE [over budget]
    #     A uid's budget binds the jobs that ask the daemon (NOTE [finding the
    #     daemon] in ``shmloader.config``); a job that did not (``SHMLOADER_DAEMON=off``,
    #     or memory taken before it found the daemon) can hold more than its uid's
    #     budget, and nothing can take that memory back. In node mode the daemon
    #     counts every job of a uid it sees in the ring directories, embedded or
    #     not, and when the uid holds more than its budget it marks each of its
    #     live jobs that holds memory: ``over_budget`` in ``stat --json`` (the job,
    #     and the uid's row with ``over_budget_bytes``), ``OVER BUDGET`` in the
    #     table, ``shmloaderd_job_over_budget`` and ``shmloaderd_uid_over_budget``
    #     in the metrics, and one warning in its log per job when it is first
    #     marked (and a line when it is back within). Its next ``admit``, if it
    #     asks, is refused as any over the budget.
    def note_over_budget(self, doc: dict[str, Any]) -> None:
        """Log the jobs newly marked over their uid's budget, and those back within it
        (NOTE [over budget]); called once per reap pass."""
        uids = (doc.get("daemon") or {}).get("uids") or {}
        marked = {(j["uid"], j["token"]): j for j in doc["jobs"] if j.get("over_budget")}
        for key, j in marked.items():
            if key in self.over_budget:
                continue
            row = uids.get(str(key[0])) or {}
            how = (
                "registered with shmloaderd"
                if j.get("registered")
                else "not registered: it runs embedded (SHMLOADER_DAEMON=off, or it has not "
                "found the daemon yet), its memory was never admitted"
            )
            log.warning(
                "job %s (ring %s) of uid %d (%s) is over its uid's budget: the uid's jobs hold "
                "%s of %s; the job holds %s, %s. shmloaderd cannot take back memory already "
                "held; it refuses the uid's next admissions",
                j.get("job") or "-",
                j["token"],
                key[0],
                row.get("user") or key[0],
                human_bytes(row.get("bytes") or 0),
                human_bytes(row.get("budget_bytes") or 0),
                human_bytes(j.get("bytes") or 0),
                how,
            )
        live = {(j["uid"], j["token"]) for j in doc["jobs"] if j.get("state") == "live"}
        for key, name in self.over_budget.items():
            if key not in marked and key in live:
                log.info("%s of uid %d is within its uid's budget again", name, key[0])
        self.over_budget = {
            k: f"job {j.get('job') or '-'} (ring {j['token']})" for k, j in marked.items()
        }


def mark_over_budget(jobs: list[dict[str, Any]], uids: dict[str, Any]) -> None:
    """``over_budget`` on each job: live, holding memory, of a uid over its budget
    (NOTE [over budget])."""
    for j in jobs:
        row = uids.get(str(j.get("uid")))
        j["over_budget"] = bool(
            row and row.get("over_budget") and j.get("state") == "live" and j.get("bytes")
        )


def left(budget: int | None, used: int) -> int | None:
    return None if budget is None else max(budget - used, 0)
