"""What the daemon knows about the jobs (rings) of this node, and the budget.

It owns the registry of jobs, each keyed by uid and token (NOTE [whose job]),
entered by ``register``, by an ``admit`` for an unknown token or by the reaper's
discovery of a live control segment, and dropped when its processes are dead,
its ring closed or it unregistered (its states in
docs/internals/state-machines.md); admission against the node and per-uid
budgets by observed bytes only (NOTE [budget]), the ended jobs ``stat`` still
shows (NOTE [dead jobs stay visible]) and the bounds on all of it (NOTE [bounded
state]). It reads the node inventory and ``/proc``; it unlinks nothing itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmloader._node import segment
from shmloader._node.inventory import (
    DEVICE_REPORTED,
    Entry,
    job_pids,
    observed_bytes,
    process_uid,
    ring_dirs,
    token_entries,
)
from shmloader._node.segment import process_alive, shm_free_bytes
from shmloader.errors import human_bytes

from .tenants import user_name

log = logging.getLogger("shmloaderd")

GRANT_TTL_S = 30.0
# NOTE [bounded state]
#     Whatever clients send, the daemon's memory stays bounded: at most
#     ``MAX_JOBS`` jobs (in node mode at most ``MAX_UID_JOBS`` of one uid but
#     root's, so that one user cannot fill it for the others) and ``MAX_ENDED``
#     ended ones; per job, ``report`` rows only for ranks of its
#     registered group (or, for a job not registered, of the group its control
#     segment describes), at most ``MAX_OWNERS`` owner pids, ``MAX_GRANTS``
#     pending grants and ``MAX_SEGMENTS`` declared segment names.
#
#     What clients send is bounded before it is kept. The control socket is a
#     ZeroMQ ``STREAM`` socket over which the daemon speaks ZMTP itself
#     (``zmtp``): a ``ROUTER`` keeps every frame of a multipart message until
#     its last, with no bound (``MAXMSGSIZE`` bounds a frame, ``RCVHWM``
#     counts finished messages only), so one local user's 1,536 frames of
#     1 MiB with MORE grew the root daemon by 1.5 GiB. Now libzmq queues at
#     most ``zmtp.RCVHWM`` chunks of 8 KiB a connection and reads no more of
#     it until the daemon takes them; the daemon keeps, of requests not
#     answered yet, at most ``zmtp.CONN_BYTES`` a connection and
#     ``zmtp.UID_BYTES`` for all connections of a uid (root's too), a message
#     of at most ``zmtp.MAX_FRAMES`` frames, each checked from its header
#     before its bytes are kept; replies wait in pieces of ``zmtp.PIECE``, at
#     most ``zmtp.SNDHWM`` queued, and no further request of a connection is
#     read while a piece of its replies waits. A connection past a bound, or
#     one holding an unfinished request or unread replies for
#     ``zmtp.UNFINISHED_S``, is dropped and logged (``dropped a connection
#     of uid ...``); the others, its uid's included, are still served. With
#     ``--max-uid-connections`` (NOTE [connection bound] in ``guard``) this
#     bounds what one user can make the daemon hold (docs/operating.md states
#     the figures); the shipped unit adds ``MemoryMax=`` for the whole.
#: Jobs the registry tracks at most: a runaway client cannot grow it without bound.
MAX_JOBS = 4096
#: Jobs one uid other than root may have tracked at once in node mode: one user's
#: junk (admits of invented tokens, planted control segments) cannot fill the
#: registry for the others (NOTE [bounded state]).
MAX_UID_JOBS = 256
#: Per job (NOTE [bounded state]).
MAX_OWNERS = 64
MAX_GRANTS = 256
MAX_SEGMENTS = 4096
#: How long a dead job stays in ``stat`` after it was reaped (NOTE [dead jobs stay visible]).
ENDED_KEEP_S = 600.0
#: Dead-job records one uid keeps (its oldest go first): one user's dead jobs
#: never evict another's (NOTE [dead jobs stay visible]).
MAX_UID_ENDED = 256
#: Dead-job records in all; past it the oldest of the uid keeping the most goes.
MAX_ENDED = 4096


#: What a ``report`` may set for one rank.
REPORT_FIELDS = (
    "published", "consumed", "receive_ms", "lag", "role", "wait_ms_p50", "wait_ms_p95",
    "wait_ms_p99", "wait_share", "wait_hist", "wait_ms_sum", "bytes", *DEVICE_REPORTED,
)  # fmt: skip


#: A job's key: (uid, token) (NOTE [whose job]).
Key = tuple[int, str]

#: Why an admission was refused: the ``reason`` of a uid's ``last_refusal`` in
#: ``stat --json`` and the label of ``shmloaderd_uid_refusals_total`` (NOTE [budget]).
REFUSALS = (
    "uid_budget",  # the uid's jobs together would exceed its --uid-budget
    "node_budget",  # all jobs would exceed the node --budget
    "shm_full",  # /dev/shm (the ring directory) has not that much free
    "unwatched_dir",  # node mode: a ring in a directory the daemon does not watch
    "pending_grants",  # too many grants whose memory has not shown up yet
    "registry_full",  # the daemon tracks its most jobs (of that uid)
    "denied",  # node mode: the request named what is not the asker's
)


class RegistryFull(Exception):
    """Too many jobs: the request is answered with an error, nothing is tracked."""


@dataclass
class Grant:
    nbytes: int
    expires: float
    baseline: int  # the job's observed bytes when granted


@dataclass
class Job:
    token: str
    registered: bool = False
    group: list[int] | None = None
    node: list[int] | None = None
    leader: int | None = None
    writer: int | None = None
    world: int | None = None
    pids: dict[int, tuple[int, int]] = field(default_factory=dict)
    owners: set[tuple[int, int]] = field(default_factory=set)  # pids without a rank
    segments: dict[str, int] = field(default_factory=dict)
    grants: list[Grant] = field(default_factory=list)
    observed: int = 0
    ctl_seen: bool = False
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    since: float = field(default_factory=time.time)
    name: str | None = None  # the job's name (SHMLOADER_JOB or the launcher's run id)
    # NOTE [pid namespaces]: namespace of a known (pid, start); the writer's as a hint
    pidns: dict[tuple[int, int], int] = field(default_factory=dict)
    pidns_hint: int = 0
    uid: int | None = None  # whose job (NOTE [whose job])
    ctl_dir: str | None = None  # where its control segment was last seen (None: nowhere)

    @property
    def key(self) -> Key:
        """(uid, token): the job's key in the registry (NOTE [whose job])."""
        return (self.uid, self.token)  # type: ignore[return-value]

    def all_pids(self) -> set[tuple[int, int]]:
        return set(self.pids.values()) | self.owners

    # NOTE [pid namespaces]
    #     Clients name their processes by (pid, start time) as they see them. The
    #     daemon can judge such a pid only when the process lives in the daemon's
    #     own pid namespace (containers that share ``/dev/shm`` and the daemon's
    #     socket but not pids: the default between containers of one Kubernetes
    #     pod). Clients send the inode of their pid namespace with every pid
    #     (``register``'s ``pids``, ``admit``'s and ``adopt``'s ``pidns``); a job
    #     whose control segment was seen also carries its writer's namespace in
    #     that header (the hint for pids sent without one, by older clients or in
    #     a control description). A pid of another namespace is never called dead:
    #     a job whose pids are all foreign ends when its ring is closed (its
    #     control segment gone) or nothing of it is left, never because ``kill 0``
    #     found no such pid here. Comparing raw pids dropped such a job at the
    #     first reaper pass: its bytes stopped counting against the budget and its
    #     reports were lost. The namespaces are kept per known pid only, so they
    #     are bounded with the pids (NOTE [bounded state]).
    def note_namespace(self, pid: int, start: int, pidns: int | None) -> None:
        """Record the pid namespace of a known process (NOTE [pid namespaces])."""
        if pidns:
            self.pidns[(pid, start)] = pidns

    def alive(self) -> bool | None:
        """Any known process alive; None when no process is known or can be judged here.

        False only when every known process lives in our pid namespace and is
        gone (NOTE [pid namespaces]).
        """
        pids = self.all_pids()
        self.pidns = {k: v for k, v in self.pidns.items() if k in pids}  # bounded
        mine = segment.MY_PIDNS
        judged = []
        for pid, start in pids:
            ns = self.pidns.get((pid, start)) or self.pidns_hint
            if ns and mine and ns != mine:
                continue  # another pid namespace: cannot be judged by its pid
            judged.append(process_alive(pid, start))
        if any(judged):
            return True
        if not judged or len(judged) < len(pids):
            return None
        return False

    def pending(self, now: float) -> int:
        self.grants = [g for g in self.grants if g.expires > now]
        if not self.grants:
            return 0
        grown = max(0, self.observed - self.grants[0].baseline)
        return max(0, sum(g.nbytes for g in self.grants) - grown)

    # Memory a job holds is what the daemon *observes* (NOTE [honest bytes] in
    # ``shmloader._node.inventory``: its segments named in /dev/shm and the writer's
    # mappings of its ring in ``/proc/<pid>/maps``, unlinked slots included), plus
    # *pending grants*: bytes ``admit`` granted that have not shown up yet. A grant
    # stops counting once the job's observed bytes grew by it, or after
    # ``GRANT_TTL_S``. Nothing a client declares (``register``'s or ``segment``'s
    # ``bytes``, a ring's own counters) counts: a client that claims a
    # 2**62-byte segment holds nothing more for it.
    def usage(self, now: float) -> int:
        """Observed bytes plus pending grants; declared bytes never count (NOTE [budget])."""
        return self.observed + self.pending(now)

    def ranks(self) -> set[int]:
        """Ranks that may report: the registered (or described) group and node."""
        return set(self.group or ()) | set(self.node or ()) | set(self.pids)

    def describe(self) -> str:
        """For log lines and messages: the job's name (when it has one), token, ranks, pids."""
        ranks = ",".join(map(str, self.group or sorted(self.pids))) or "?"
        pids = ",".join(str(p) for p, _ in sorted(self.all_pids())) or "?"
        if self.name:
            return f"job {self.name} (ring {self.token}, ranks {ranks}, pids {pids})"
        return f"job {self.token} (ranks {ranks}, pids {pids})"


# NOTE [dead jobs stay visible]
#     A job whose processes died (SIGKILL, OOM) is reaped within a reaper pass;
#     dropping it at once made it vanish from ``stat`` within a second, so an
#     operator never saw that it died or what was freed. Its record moves to
#     ``ended`` (token -> ``Ended``: when, why, what the reaper freed, with its
#     name, group and pids) and ``stat`` shows it as ``dead`` for
#     ``ENDED_KEEP_S``. Rings closed in order leave no record. Each uid keeps
#     its own share, as live jobs do (``MAX_UID_JOBS``): at most
#     ``MAX_UID_ENDED`` records of one uid, its own oldest dropped first, so
#     one user letting 300 jobs die removes no other user's record; past
#     ``MAX_ENDED`` in all, the oldest of the uid keeping the most goes. A
#     record keeps what ``stat`` shows (no reports, grants, segment names).
@dataclass
class Ended:
    """A dead job's record (NOTE [dead jobs stay visible])."""

    job: Job
    unix: float
    why: str
    reaped_segments: int = 0
    reaped_bytes: int = 0


class Registry:
    """Jobs by token and the node budget. Used from the daemon's one loop thread."""

    def __init__(
        self,
        budget: Callable[[], int | None],
        warm_bytes: Callable[[], int] = lambda: 0,
        shrink_warm: Callable[[int], int] = lambda need: 0,
        uid_budget: Callable[[int | None], int | None] = lambda uid: None,
        tenants: bool = False,
        dirs: list[str] | None = None,
    ) -> None:
        self.jobs: dict[Key, Job] = {}  # (uid, token): NOTE [whose job]
        self.me = os.geteuid()  # whose a job is when no uid is given (single-user mode)
        self.dirs = dirs  # the ring directories (None: ``admin.ring_dirs()``)
        self.budget = budget
        self.warm_bytes = warm_bytes
        self.shrink_warm = shrink_warm
        self.uid_budget = uid_budget
        self.tenants = tenants  # node mode: refusals detail only the asker's jobs
        self.granted = 0
        self.refused = 0
        self.ended: dict[Key, Ended] = {}  # NOTE [dead jobs stay visible]
        self.admissions: dict[tuple[int, str], int] = {}  # (uid, "granted"|"refused") -> n
        # NOTE [budget]: refusals per (uid, reason of REFUSALS) and each uid's last one
        self.refusals: dict[tuple[int, str], int] = {}
        self.last_refusal: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------- requests

    # NOTE [whose job]
    #     A job is keyed by (uid, token), never by its token alone. Tokens are
    #     names, and names in /dev/shm are world-listable (a ring's probe segment
    #     shows its token during discovery), so a token cannot say whose a job is.
    #     Whose it is comes from two things nobody can forge for another user,
    #     checked together: the ``SO_PEERCRED`` uid of the client that registers or
    #     admits it (NOTE [tenants] in ``tenants``), and the owner of each segment
    #     (the file's uid, which its header must repeat). A request acts on the job
    #     of its token *of the peer's uid* (root may name any uid's); a job counts
    #     only the segments of its own uid, and only processes running as that uid
    #     (``inventory.job_pids``, ``_same_user``) for mappings and liveness; a job
    #     discovered by its control segment is that file owner's. Another user's
    #     control segment planted under our token, or an ``admit`` naming our
    #     token, therefore makes a job of *theirs* that holds their own files, and
    #     takes nothing of ours: before, the registry gave a token nobody had
    #     registered to the first uid owning a control segment of it and kept it
    #     there, and the real writer's ``register``/``admit`` were refused.
    def find(self, token: str, uid: int | None = None, *, any_uid: bool = False) -> Job | None:
        """The job ``token`` of ``uid`` (NOTE [whose job]); ``any_uid`` (root in node
        mode): else the job of that token of any uid, root's own first."""
        uid = self.me if uid is None else uid
        job = self.jobs.get((uid, token))
        if job is None and any_uid:
            same = [j for (_, t), j in self.jobs.items() if t == token]
            job = min(same, key=lambda j: -1 if j.uid is None else j.uid, default=None)
        return job

    def job(self, token: str, uid: int | None = None, *, any_uid: bool = False) -> Job:
        """The job ``token`` of ``uid``, made if new (NOTE [whose job]).

        ``any_uid`` (root in node mode, who may act for a user): an existing job
        of that token of any uid, else one made for the owner of its control
        segment when a single uid owns them, else for ``uid``.
        """
        uid = self.me if uid is None else uid
        job = self.find(token, uid, any_uid=any_uid)
        if job is not None:
            return job
        if any_uid:
            found = self._control_owners(token)
            uid = next(iter(found)) if len(found) == 1 else uid
        if len(self.jobs) >= MAX_JOBS:
            raise RegistryFull(
                f"shmloaderd already tracks {MAX_JOBS} jobs; unregister finished ones"
            )
        if self._uid_full(uid):
            raise RegistryFull(
                f"shmloaderd already tracks {MAX_UID_JOBS} jobs of uid {uid}, the most one "
                "user may have at once; end (or unregister) some of them"
            )
        job = self.jobs[(uid, token)] = Job(token, uid=uid)
        self.ended.pop((uid, token), None)  # alive again (a restart that kept its token)
        return job

    def _uid_full(self, uid: int) -> bool:
        """Whether ``uid`` has its most jobs (node mode; NOTE [bounded state])."""
        if not self.tenants or uid == 0:
            return False
        return sum(1 for u, _ in self.jobs if u == uid) >= MAX_UID_JOBS

    def _control_owners(self, token: str) -> set[int]:
        """Uids of the valid control segments of ``token`` in the ring directories."""
        out = set()
        for e in token_entries(token, every_uid=self.tenants, dirs=self.dirs):
            if e.header is not None and e.header.kind_name == "control":
                out.add(e.header.uid)
        return out

    def register(
        self, f: dict[str, Any], uid: int | None = None, *, any_uid: bool = False
    ) -> dict[str, Any]:
        known = self.find(f["token"], uid, any_uid=any_uid) is not None
        job = self.job(f["token"], uid, any_uid=any_uid)
        job.registered = True
        job.group = f["group"]
        job.pids = f["pids"]
        job.owners.clear()
        job.pidns.clear()
        for rank, ns in f.get("pids_ns", {}).items():
            if rank in job.pids:
                job.note_namespace(*job.pids[rank], ns)
        for key in ("node", "leader", "writer", "world"):
            if key in f:
                setattr(job, key, f[key])
        if "job" in f:
            job.name = f["job"]
        for name, nbytes in f.get("segments", {}).items():
            if name in job.segments or len(job.segments) < MAX_SEGMENTS:
                job.segments[name] = nbytes
        job.reports = {r: v for r, v in job.reports.items() if r in job.ranks()}
        log.info(
            "registered %s of uid %s%s: %d segment(s), %s",
            job.describe(),
            job.uid,
            " (was known)" if known else "",
            len(job.segments),
            human_bytes(sum(job.segments.values())),
        )
        return {"ok": True, "token": job.token, "known": known}

    def segment(
        self, f: dict[str, Any], uid: int | None = None, *, any_uid: bool = False
    ) -> dict[str, Any]:
        job = self.find(f["token"], uid, any_uid=any_uid)
        if job is None:
            return {"ok": False, "error": f"unknown token {f['token']}: register the job first"}
        if f["action"] == "add":
            if f["name"] not in job.segments and len(job.segments) >= MAX_SEGMENTS:
                return {"ok": False, "error": f"job {job.token} already has {MAX_SEGMENTS} "
                        "segments; remove retired ones"}  # fmt: skip
            job.segments[f["name"]] = f.get("bytes", 0)
        else:
            job.segments.pop(f["name"], None)
        return {"ok": True, "token": job.token, "segments": len(job.segments)}

    # NOTE [budget]
    #     ``admit`` refuses when the jobs' usage plus the warm pool plus the request
    #     would exceed the budget (the pool is shrunk first to make room), or when
    #     /dev/shm itself has not that much free. A refusal names the budget, the
    #     bytes in use and the jobs (token, ranks, pids) that hold them. A request
    #     is refused without being recorded, so asking for too much costs nothing
    #     to the other jobs. In node mode (NOTE [tenants] in ``tenants``) each job
    #     belongs to a uid, and a uid with a budget (``--uid-budget``,
    #     ``--default-uid-budget``) is refused once all its jobs together would
    #     exceed it, whatever other uids hold; the node budget still caps the sum.
    #     A refusal shown to a user details only that user's jobs: the rest of the
    #     node is a count and a total. Each refusal is counted per uid and reason
    #     (``REFUSALS``), and the uid's last one (reason, message, when) is kept for
    #     ``stat --json`` and the metrics: an operator reads every refusal where
    #     their tools look, not only in the log and the user's exception.
    def admit(
        self, f: dict[str, Any], uid: int | None = None, *, any_uid: bool = False
    ) -> dict[str, Any]:
        token, nbytes = f["token"], f["bytes"]
        job = self.job(token, uid, any_uid=any_uid)
        if "pid" in f and not job.pids and len(job.owners) < MAX_OWNERS:
            job.owners.add((f["pid"], f.get("start", 0)))
            job.note_namespace(f["pid"], f.get("start", 0), f.get("pidns"))
        self.observe_one(job)
        now = time.monotonic()
        budget = self.budget()
        in_use = self.in_use(now)
        free = shm_free_bytes()
        pending_total = sum(j.pending(now) for j in self.jobs.values())
        reason = ""
        job.pending(now)  # drops expired grants
        uid_budget = self.uid_budget(job.uid)
        uid_use = self.uid_in_use(job.uid, now)
        code = ""  # one of REFUSALS once refused
        if self.tenants and job.ctl_dir is None:  # NOTE [watched ring directories]
            reason, code = self._unwatched(job, f.get("shm_dir")), "unwatched_dir"
        elif len(job.grants) >= MAX_GRANTS:
            code = "pending_grants"
            reason = (
                f"{job.describe()} has {MAX_GRANTS} admissions granted whose memory has not "
                f"shown up in /dev/shm yet (they expire after {GRANT_TTL_S:g} s); create the "
                "segments admitted before asking for more"
            )
        elif uid_budget is not None and uid_use + nbytes > uid_budget:
            code = "uid_budget"
            reason = (
                f"the budget of uid {job.uid} ({user_name(job.uid)}) on this node is "
                f"{human_bytes(uid_budget)} ({uid_budget} bytes) and its jobs use "
                f"{human_bytes(uid_use)}: {self.holders(now, job.uid, only_uid=True)}; "
                f"{job.describe()} asked {human_bytes(nbytes)}. Ask the node's operator for a "
                f"larger --uid-budget {job.uid}=SIZE, lower SHMLOADER_SLOTS or run fewer of "
                "your jobs on this node at once"
            )
        elif budget is not None and in_use + nbytes > budget:
            self.shrink_warm(in_use + nbytes - budget)
            in_use = self.in_use(now)
        if not reason and budget is not None and in_use + nbytes > budget:
            code = "node_budget"
            reason = (
                f"the node budget of shmloaderd is {human_bytes(budget)} ({budget} bytes) and "
                f"{human_bytes(in_use)} is in use by {self.holders(now, job.uid)}; "
                f"{job.describe()} asked "
                f"{human_bytes(nbytes)}. Raise the daemon's --budget, lower SHMLOADER_SLOTS or "
                "run fewer jobs on this node at once"
            )
        elif not reason and free is not None and free - pending_total < nbytes:
            code = "shm_full"
            reason = (
                f"/dev/shm has {human_bytes(max(free - pending_total, 0))} free (after "
                f"{human_bytes(pending_total)} granted but not yet allocated); {job.describe()} "
                f"asked {human_bytes(nbytes)}. Give the node or container more shared memory "
                "(docker --shm-size) or lower SHMLOADER_SLOTS"
            )
        reply: dict[str, Any] = {
            "ok": True,
            "admitted": not reason,
            "budget": budget,
            "in_use": in_use,
            "shm_free": free,
        }
        if uid_budget is not None:
            reply.update(uid=job.uid, uid_budget=uid_budget, uid_in_use=uid_use)
        result = "refused" if reason else "granted"
        key = (-1 if job.uid is None else job.uid, result)
        self.admissions[key] = self.admissions.get(key, 0) + 1
        if reason:
            self.refused += 1
            reply["reason"], reply["refusal"] = reason, code
            self.note_refusal(job.uid, code, reason)
            log.warning("refused %d bytes of uid %s (%s): %s", nbytes, job.uid, code, reason)
        else:
            self.granted += 1
            job.grants.append(Grant(nbytes, now + GRANT_TTL_S, job.observed))
        return reply

    def note_refusal(self, uid: int | None, code: str, message: str) -> None:
        """Count a refusal of ``uid`` and keep it as its last (NOTE [budget])."""
        key = -1 if uid is None else uid
        self.refusals[(key, code)] = self.refusals.get((key, code), 0) + 1
        self.last_refusal[key] = {"reason": code, "message": message[:1024], "unix": time.time()}

    # NOTE [watched ring directories]
    #     In node mode ``admit`` refuses a job with no control segment of its uid
    #     in the ring directories the daemon watches (``--shm-dir``, /dev/shm):
    #     such a ring (``SHMLOADER_SHM_DIR`` a sub-directory of /dev/shm, or any
    #     other directory) would count 0 bytes against its budgets and never be
    #     reaped after a crash. The writer creates its control segment before it
    #     asks for its first slot, so a ring in a watched directory is always seen
    #     by then. The refusal names the directories and the fix. The daemon does
    #     not follow a directory a job names: reaping as root inside a directory a
    #     user controls is open to that user swapping the path under the unlink.
    #     So a shmloader job checks first (``hello`` says ``node_mode`` and
    #     ``shm_dirs``; ``DaemonClient.check_ring_dir``) and makes nothing in
    #     such a directory: no control segment is left there for nobody to reap
    #     after a crash. This refusal stays for clients that do not check.
    def _unwatched(self, job: Job, where: Any) -> str:
        """Why ``job`` is refused when no control segment of its uid is in a
        ring directory of ours (NOTE [watched ring directories])."""
        dirs = ", ".join(self.dirs or ring_dirs())
        said = f" (its ring directory is {where})" if isinstance(where, str) else ""
        return (
            f"{job.describe()} of uid {job.uid}{said} has no control segment in the ring "
            f"directories shmloaderd watches ({dirs}): its memory could be neither counted "
            "against a budget nor reaped after a crash. Set SHMLOADER_SHM_DIR to one of "
            "them (or unset it for /dev/shm), or ask the node's operator to add the "
            "directory to shmloaderd's --shm-dir"
        )

    def report(
        self, f: dict[str, Any], uid: int | None = None, *, any_uid: bool = False
    ) -> dict[str, Any]:
        job = self.find(f["token"], uid, any_uid=any_uid)
        if job is None:
            return {"ok": False, "error": f"unknown token {f['token']}: register the job first"}
        if f["rank"] not in job.ranks():  # NOTE [bounded state]
            known = ",".join(map(str, sorted(job.ranks()))) or "none yet"
            return {
                "ok": False,
                "error": f"rank {f['rank']} is not in the group of {job.describe()} "
                f"(ranks {known}); register the job with its group first",
            }
        entry = job.reports.setdefault(f["rank"], {})
        for key in REPORT_FIELDS:
            if key in f:
                entry[key] = f[key]
        entry["updated_unix"] = time.time()
        return {"ok": True, "token": job.token}

    def unregister(
        self, f: dict[str, Any], uid: int | None = None, *, any_uid: bool = False
    ) -> dict[str, Any]:
        job = self.find(f["token"], uid, any_uid=any_uid)
        if job is not None:
            del self.jobs[job.key]
            log.info("unregistered %s", job.describe())
        return {"ok": True, "token": f["token"], "known": job is not None}

    # --------------------------------------------------------------- state

    def in_use(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        return sum(j.usage(now) for j in self.jobs.values()) + self.warm_bytes()

    def uid_in_use(self, uid: int | None, now: float | None = None) -> int:
        """Bytes all jobs of ``uid`` hold (observed plus pending grants)."""
        now = time.monotonic() if now is None else now
        return sum(j.usage(now) for j in self.jobs.values() if j.uid == uid)

    def holders(self, now: float, viewer: int | None = None, *, only_uid: bool = False) -> str:
        """Who holds the memory, for a refusal. In node mode a non-root ``viewer``
        sees its own jobs in detail and the other uids' as a count and a total
        (NOTE [budget]); ``only_uid``: the viewer's jobs alone."""
        jobs = sorted(self.jobs.values(), key=lambda j: -j.usage(now))
        cut = self.tenants and viewer not in (None, 0)
        mine = [j for j in jobs if not (cut or only_uid) or j.uid == viewer]
        parts = [f"{j.describe()} {human_bytes(j.usage(now))}" for j in mine if j.usage(now)]
        if only_uid:
            return "; ".join(parts) or "nothing"
        others = [j for j in jobs if j not in mine and j.usage(now)]
        if others:
            total = sum(j.usage(now) for j in others)
            parts.append(f"{len(others)} job(s) of other users {human_bytes(total)}")
        warm = self.warm_bytes()
        if warm:
            parts.append(f"the warm segments {human_bytes(warm)}")
        return "; ".join(parts) or "nothing"

    def observe_one(self, job: Job) -> None:
        """Refresh one job's observed bytes from its ring directory now (before an admission)."""
        entries = token_entries(job.token, every_uid=self.tenants, dirs=self.dirs)
        self._observe(job, [e for e in entries if e.header is not None])

    def _observe(self, job: Job, entries: list[Entry]) -> None:
        """Observed bytes (NOTE [honest bytes] in ``shmloader._node.inventory``): the named
        segments of the job's uid (NOTE [whose job]), and the mappings of the
        writer (the live owner of the control segment: one ``/proc/<pid>/maps``
        read per job and pass, whatever a client claims about pids)."""
        entries = [e for e in entries if e.header is not None and e.header.uid == job.uid]
        ctl = next((e for e in entries if e.header and e.header.kind_name == "control"), None)
        job.ctl_dir = None if ctl is None else ctl.directory
        if ctl is not None and ctl.header is not None:
            job.ctl_seen = True
            job.pidns_hint = ctl.header.pidns  # NOTE [pid namespaces]
        if ctl is not None and ctl.header is not None and ctl.alive:
            pids = job_pids(ctl.header, ctl.description or {})
            job.observed = observed_bytes(job.token, entries, pids)
        else:
            job.observed = sum(e.size for e in entries)

    def observe(
        self, entries: list[Entry], reaped: dict[Key, tuple[int, int]] | None = None
    ) -> list[str]:
        """Update every job from a scan; discover new live jobs; drop ended ones.

        ``reaped``: (uid, token) -> (segments, bytes) the reaper just freed. A
        dropped job that died, or whose segments were reaped, is kept in
        ``ended`` (NOTE [dead jobs stay visible]). Returns the jobs dropped,
        with why (for the log).
        """
        reaped = reaped or {}
        by_key: dict[Key, list[Entry]] = {}
        for e in entries:
            if e.header is not None:
                by_key.setdefault((e.header.uid, e.header.token), []).append(e)
        for key, es in by_key.items():
            job = self.jobs.get(key)
            ctl = next((e for e in es if e.header and e.header.kind_name == "control"), None)
            if job is None:
                if ctl is None or not ctl.alive or len(self.jobs) >= MAX_JOBS:
                    continue  # probes and dead leftovers are not jobs
                if self._uid_full(key[0]):
                    continue  # NOTE [bounded state]
                job = self.jobs[key] = Job(key[1], uid=key[0])
                _from_description(job, ctl)
                log.info(
                    "discovered %s of uid %d from its control segment %s",
                    job.describe(),
                    key[0],
                    ctl.name,
                )
            elif not job.registered and ctl is not None and ctl.alive:
                _from_description(job, ctl)  # the described group bounds its reports
            self._observe(job, es)
        ended = []
        now = time.monotonic()
        for key, job in list(self.jobs.items()):
            alive = job.alive()
            closed = job.ctl_seen and key not in by_key
            idle = alive is None and not job.pending(now) and key not in by_key
            if alive is False or closed or idle:
                why = (
                    "all its processes are gone"
                    if alive is False
                    else "its ring was closed"
                    if closed
                    else "nothing of it is left"
                )
                ended.append(f"{job.describe()}: {why}")
                del self.jobs[key]
                if alive is False or key in reaped:
                    self.record_end(job, "its processes died", *reaped.get(key, (0, 0)))
        self.forget_ended()
        return ended

    def record_end(self, job: Job, why: str, segments: int, nbytes: int) -> None:
        """Keep a dead job's record (NOTE [dead jobs stay visible])."""
        self.ended.pop(job.key, None)
        mine = [k for k in self.ended if k[0] == job.key[0]]
        for key in mine[: max(0, len(mine) - MAX_UID_ENDED + 1)]:  # NOTE [bounded state]
            del self.ended[key]
        while len(self.ended) >= MAX_ENDED:
            counts: dict[int, int] = {}
            for uid, _ in self.ended:
                counts[uid] = counts.get(uid, 0) + 1
            most = max(counts, key=counts.__getitem__)
            del self.ended[next(k for k in self.ended if k[0] == most)]
        job.reports, job.grants, job.segments = {}, [], {}  # not shown; not kept
        self.ended[job.key] = Ended(job, time.time(), why, segments, nbytes)

    def note_reaped(self, key: Key, segments: int, nbytes: int) -> None:
        """Segments of an already ended job reaped later add to its record."""
        rec = self.ended.get(key)
        if rec is not None:
            rec.reaped_segments += segments
            rec.reaped_bytes += nbytes

    def forget_ended(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for key, rec in list(self.ended.items()):
            if now - rec.unix > ENDED_KEEP_S:
                del self.ended[key]


def _from_description(job: Job, ctl: Entry) -> None:
    desc = ctl.description or {}
    assert ctl.header is not None
    if (ctl.header.pid, ctl.header.start) not in job.owners and len(job.owners) < MAX_OWNERS:
        job.owners.add((ctl.header.pid, ctl.header.start))
    job.note_namespace(ctl.header.pid, ctl.header.start, ctl.header.pidns)
    job.pidns_hint = ctl.header.pidns
    pids = desc.get("pids")
    if isinstance(pids, dict):
        for rank, pair in pids.items():
            ok = (
                isinstance(pair, list)
                and len(pair) in (2, 3)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
            )
            if ok and not _same_user(pair, ctl.header):
                continue  # NOTE [whose job]: another user's process is not this job's
            if str(rank).isdigit() and ok:
                job.pids[int(rank)] = (pair[0], pair[1])
                if len(pair) == 3:  # [pid, start, pidns]
                    job.note_namespace(pair[0], pair[1], pair[2])
    for key, attr in (("group", "group"), ("node", "node")):
        value = desc.get(key)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            setattr(job, attr, value)
    for key in ("leader", "writer", "world"):
        value = desc.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(job, key, value)
    name = desc.get("job")
    if isinstance(name, str):
        job.name = name[:128]


def _same_user(pair: list, ctl: Any) -> bool:
    """Whether a described ``[pid, start, pidns?]`` may be a process of the control
    segment's owner: of another pid namespace (not checkable here), gone, or of
    that uid."""
    ns = pair[2] if len(pair) == 3 and pair[2] else ctl.pidns
    if ns and segment.MY_PIDNS and ns != segment.MY_PIDNS:
        return True
    uid = process_uid(pair[0])
    return uid is None or uid == ctl.uid
