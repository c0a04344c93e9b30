"""What a rank counts and reports: its counters (``RankStats``) and ``shmloader stat``'s rows.

Every role counts into one ``RankStats`` (each counter written by the role that
does the counted work); a ``Reporter`` turns them, at most once a second, into
the writer's ring description (what a scan of /dev/shm shows) and the daemon's
per-rank reports (docs/internals/flow.md). It touches the ring's description and
the daemon client it is given (``connect_daemon``: None in embedded mode),
nothing else.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch.distributed as dist

from .._node.inventory import DEVICE_REPORTED
from .._proto.waits import WaitHistogram
from .._topology import GroupTopology
from .._transport.daemon_client import DaemonClient
from ..config import Config

if TYPE_CHECKING:
    from ..device.stage import DeviceStage

#: Seconds between two progress reports to the daemon.
REPORT_EVERY_S = 1.0
#: Most per-rank rows a writer puts in its ring's description (for ``stat``).
DESCRIBED_RANKS = 64


class RankStats:
    """This rank's counters (``ShmLoader.stats()``) and its waits for data."""

    def __init__(self) -> None:
        # a Counter (an absent name reads 0) of ints and of float milliseconds, which
        # typeshed's Counter (int values only) does not admit
        self.counts = cast("dict[str, Any]", collections.Counter())
        self.waits = WaitHistogram()  # ms per batch, O(1) each (``waits``)
        self.wait_since: float | None = None  # perf_counter when this rank first waited
        #: the role's loop runs ahead: only the user's waits count (NOTE [running ahead])
        self.ahead = False

    def note_wait(self, t0: float, *, handed: bool = False) -> None:
        """Count the wait for data that started at ``perf_counter()`` ``t0``.

        ``handed``: the user's own wait for a batch handed over; a loop that
        runs ahead waits on its own thread, which no user sees.
        """
        if self.ahead and not handed:
            return
        ms = (time.perf_counter() - t0) * 1e3
        if self.wait_since is None:
            self.wait_since = t0
        self.counts["wait_ms_total"] += ms
        self.waits.add(ms)

    def wait_fields(self) -> dict[str, Any]:
        """This rank's waits for ``stat``: ``wait_ms_p50``, ``wait_ms_p95``, ``wait_ms_p99``
        over recent batches and ``wait_share``, the share of wall time spent waiting; {}
        before the first batch."""
        if not len(self.waits) or self.wait_since is None:
            return {}
        wall_ms = (time.perf_counter() - self.wait_since) * 1e3
        share = min(1.0, self.counts["wait_ms_total"] / wall_ms) if wall_ms > 0 else None
        out: dict[str, Any] = {f"wait_ms_{k}": v for k, v in self.waits.recent().items()}
        out["wait_share"] = share if share is None else round(share, 4)
        return out

    def histogram(self) -> dict[str, Any]:
        """The waits since the first batch, for the daemon's Prometheus histogram."""
        return {"wait_hist": self.waits.counts, "wait_ms_sum": round(self.waits.sum_ms, 3)}


def connect_daemon(config: Config) -> DaemonClient | None:
    """The node daemon's client, or None: embedded mode (logged once if unreachable)."""
    if not config.daemon:
        return None
    client = DaemonClient(config.daemon)
    if client.connect():
        return client
    client.close()
    return None


def describe(topo: GroupTopology, job: str | None) -> dict:
    """A writer's ring as ``stat`` and the daemon see it (without per-rank rows)."""
    return {
        "token": topo.ring_token,
        "group": list(topo.ranks),
        "leader": topo.leader,
        "writer": topo.me,
        "node": list(topo.node),
        # NOTE [pid namespaces] in shmloaderd.registry: a pid means something
        # only in its namespace
        "pids": {str(f.rank): [f.pid, f.start, f.pidns] for f in topo.facts if f.rank in topo.node},
        "world": dist.get_world_size(),
        "job": job,
    }


def device_fields(stage: DeviceStage | None) -> dict[str, Any]:
    """This rank's device-delivery counters for ``shmloader stat``; empty without a device.

    The raw counters (``inventory.DEVICE_REPORTED``); ``stat`` derives the
    bandwidth from them (``inventory.device_fields``).
    """
    if stage is None or not stage.on_device:
        return {}
    s = stage.stats()
    fields = {key: s[key] for key in DEVICE_REPORTED}
    refused = fields["device_registration_refused"]
    if isinstance(refused, str):  # the daemon takes printable text of <= 128 characters
        fields["device_registration_refused"] = "".join(
            c if c.isprintable() else " " for c in refused
        )[:128]
    fields["device_copy_ms_total"] = round(float(fields["device_copy_ms_total"]), 4)
    return fields


class Announcing(Protocol):
    """What the reporter reads of a writer (``node_writer.NodeWriter``)."""

    seq: int  # batches announced
    acked: dict[int, int]  # per reader: batches it took

    def describe(self, description: dict) -> None:
        """Rewrite the ring's description (what ``stat`` finds in /dev/shm)."""
        ...


class Reporter:
    """At most once a second: this rank's progress for ``shmloader stat``.

    The writer rewrites its ring's description with per-rank rows (found by
    a scan of /dev/shm, no daemon needed); with a daemon every rank also
    reports its own row (the daemon adds followers' wait times).
    """

    def __init__(
        self,
        topo: GroupTopology,
        role: str,
        stats: RankStats,
        daemon: DaemonClient | None,
        *,
        job: str | None,
        device: Callable[[], dict[str, Any]],
    ) -> None:
        self.topo = topo
        self.role = role
        self.stats = stats
        self.daemon = daemon
        self.job = job
        self.device = device
        self.writer: Announcing | None = None  # set on a writer: it reports its readers
        self.closed = False
        self._next = 0.0
        self._told_wait = False

    def now(self) -> None:
        """Report at once (an iteration's copies settled): ``stat`` shows its final counters."""
        if self.closed:
            return
        self._next = 0.0
        with contextlib.suppress(Exception):  # a report never fails the iteration
            self.report()

    def first_wait(self) -> None:
        """The user's first wait was counted on another thread than the one that reports
        (a loop that runs ahead, NOTE [running ahead] in ``producer``): report it with the
        loop's next report instead of a second later."""
        if not self._told_wait:
            self._told_wait = True
            self._next = 0.0

    def report(self) -> None:
        """Report if a second has passed since the last report."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + REPORT_EVERY_S
        waits, hist = self.stats.wait_fields(), self.stats.histogram()
        device = self.device()
        topo, counts, client, writer = self.topo, self.stats.counts, self.daemon, self.writer
        if writer is not None:
            published = counts["bytes_published"] or counts["bytes_received"]
            mine = {"role": self.role, "batches": writer.seq, **waits,
                    "traffic_bytes": published, **device}  # fmt: skip
            ranks = {str(topo.me): mine}
            # an ACK of the writer's last word (END, ERROR, STOP) counts one past its
            # batches: what a reader took is at most what was published
            taken = {rank: min(acked, writer.seq) for rank, acked in writer.acked.items()}
            for rank, acked in taken.items():
                row = {"role": topo.role(rank), "batches": acked, "lag": writer.seq - acked}
                ranks[str(rank)] = row
            if len(ranks) > DESCRIBED_RANKS:  # the control segment holds 16 KiB
                ranks = {str(topo.me): mine}
            with contextlib.suppress(ValueError, TypeError):  # closed, or not JSON
                writer.describe({**describe(topo, self.job), "ranks": ranks})
            if client is None:
                return
            client.report(topo.ring_token, topo.me, published=writer.seq, role=self.role,
                          nbytes=published, device=device, waits={**waits, **hist})  # fmt: skip
            for rank, acked in taken.items():
                client.report(topo.ring_token, rank, consumed=acked, lag=writer.seq - acked)
        elif client is not None:
            received = counts["received"]
            mean = counts["receive_ms_total"] / received if received else None
            client.report(topo.ring_token, topo.me, consumed=received, receive_ms=mean,
                          role=self.role, nbytes=counts["bytes_received"], device=device,
                          waits={**waits, **hist})  # fmt: skip

    def close(self) -> None:
        self.closed = True
