"""Prometheus metrics (``--metrics-addr HOST:PORT``, ``--metrics-port PORT`` on 127.0.0.1).

It owns the exported series (listed in docs/internals/wire.md and
docs/operating.md; every per-job series carries ``uid``, NOTE [whose job] in
``registry``; ``sample_names`` gives every name a scrape can show, which
systemd/alerts.yml is checked against) and a custom registry with one
collector that renders the daemon's latest stats document, so a scrape never
touches /dev/shm or the daemon's loop. It imports only
``shmloader._proto.waits`` (the histogram's buckets) and the daemon's version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from shmloader._proto.waits import BOUNDS_MS, NBUCKETS

from ._version import __version__

#: The exported buckets: every 4th bound of ``waits.BOUNDS_MS`` (2**k ms), whose
#: cumulative counts are exact (a bucket edge of the rank's histogram).
_EXPORTED = [i for i, b in enumerate(BOUNDS_MS) if i % 4 == 0]


def wait_buckets(counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus ``(le seconds, cumulative count)`` pairs of a rank's wait histogram."""
    out, total, edge = [], 0, 0
    for i in _EXPORTED:
        total += sum(counts[edge : i + 1])
        edge = i + 1
        out.append((floatToGoString(BOUNDS_MS[i] / 1e3), total))
    out.append(("+Inf", total + sum(counts[edge:NBUCKETS])))
    return out


class _Collector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        doc, counters = snap["stats"], snap["counters"]
        daemon, node = doc.get("daemon") or {}, doc["node"]

        def gauge(name: str, doc_text: str, value: Any) -> Iterator[Metric]:
            if value is not None:
                yield GaugeMetricFamily(name, doc_text, value=value)

        yield GaugeMetricFamily("shmloaderd_up", "1: this daemon answers scrapes", value=1)
        info = GaugeMetricFamily(
            "shmloaderd_build_info", "the daemon's version", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        yield from gauge("shmloaderd_budget_bytes", "node budget", daemon.get("budget_bytes"))
        yield from gauge("shmloaderd_in_use_bytes", "bytes held", daemon.get("in_use_bytes"))
        yield from gauge("shmloaderd_shm_size_bytes", "/dev/shm size", node["shm_size_bytes"])
        yield from gauge("shmloaderd_shm_free_bytes", "/dev/shm free", node["shm_free_bytes"])
        yield from gauge("shmloaderd_pool_bytes", "warm segment bytes", daemon.get("pool_bytes"))
        yield from gauge("shmloaderd_jobs", "jobs on this node", len(doc["jobs"]))
        job_bytes = GaugeMetricFamily(
            "shmloaderd_job_bytes", "bytes held", labels=["token", "job", "uid"]
        )
        published = CounterMetricFamily(
            "shmloaderd_job_published", "batches published", labels=["token", "uid"]
        )
        pub_s = GaugeMetricFamily(
            "shmloaderd_job_publish_seconds_avg", "mean publish time", labels=["token", "uid"]
        )
        lag = GaugeMetricFamily(
            "shmloaderd_follower_lag_batches", "batches behind", labels=["token", "uid", "rank"]
        )
        recv = GaugeMetricFamily(
            "shmloaderd_follower_receive_seconds",
            "receive time",
            labels=["token", "uid", "rank"],
        )
        labels = ["token", "job", "uid", "rank", "role"]
        share = GaugeMetricFamily(
            "shmloaderd_rank_wait_share", "time waiting for data", labels=labels
        )
        wait = GaugeMetricFamily("shmloaderd_rank_wait_seconds_p50", "median wait", labels=labels)
        over = GaugeMetricFamily(
            "shmloaderd_job_over_budget",
            "1: the job holds memory and its uid is over its budget (NOTE [over budget])",
            labels=["token", "job", "uid"],
        )
        for job in doc["jobs"]:
            token = job["token"]
            if job.get("uid") is not None:
                over.add_metric(
                    [token, job.get("job") or "", str(job["uid"])],
                    int(bool(job.get("over_budget"))),
                )
            for rank, row in job.get("ranks", {}).items():
                uid = "" if job.get("uid") is None else str(job["uid"])
                key = [token, job.get("job") or "", uid, str(rank), row.get("role") or ""]
                if row.get("wait_share") is not None:
                    share.add_metric(key, row["wait_share"])
                if row.get("wait_ms_p50") is not None:
                    wait.add_metric(key, row["wait_ms_p50"] / 1e3)
            uid = "" if job.get("uid") is None else str(job["uid"])
            job_bytes.add_metric([token, job.get("job") or "", uid], job["bytes"])
            if job["published"] is not None:
                published.add_metric([token, uid], job["published"])
            if job["publish_ms_avg"] is not None:
                pub_s.add_metric([token, uid], job["publish_ms_avg"] / 1e3)
            for rank, f in job.get("followers", {}).items():
                if f.get("lag") is not None:
                    lag.add_metric([token, uid, str(rank)], f["lag"])
                if f.get("receive_ms") is not None:
                    recv.add_metric([token, uid, str(rank)], f["receive_ms"] / 1e3)
        hist = HistogramMetricFamily(
            "shmloaderd_rank_wait_seconds", "wait for a batch", labels=labels
        )
        for w in snap.get("waits", []):
            hist.add_metric(
                [w["token"], w["job"], w["uid"], w["rank"], w["role"]],
                wait_buckets(w["counts"]),
                sum_value=w["sum_ms"] / 1e3,
            )
        yield from (job_bytes, published, pub_s, lag, recv, share, wait, hist, over)
        yield from _per_uid(daemon.get("uids") or {})
        yield CounterMetricFamily(
            "shmloaderd_reaped_segments", "segments reaped", value=counters["reaped_segments"]
        )
        yield CounterMetricFamily(
            "shmloaderd_reaped_bytes", "bytes reaped", value=counters["reaped_bytes"]
        )
        yield CounterMetricFamily(
            "shmloaderd_reaped_sockets", "stale sockets reaped", value=counters["reaped_sockets"]
        )
        yield CounterMetricFamily(
            "shmloaderd_reap_failures",
            "reap passes that failed and files the reaper could not remove",
            value=counters.get("reap_failures", 0),
        )
        adm = CounterMetricFamily("shmloaderd_admissions", "admit answers", labels=["result"])
        adm.add_metric(["granted"], counters["granted"])
        adm.add_metric(["refused"], counters["refused"])
        yield adm
        req = CounterMetricFamily("shmloaderd_requests", "control requests", labels=["op"])
        for op, n in sorted(counters["requests"].items()):
            req.add_metric([op], n)
        yield req


def _per_uid(uids: dict[str, Any]) -> Iterator[Metric]:
    """The per-uid series, from the ``daemon.uids`` rows of the stats document."""
    labels = ["uid", "user"]
    jobs = GaugeMetricFamily("shmloaderd_uid_jobs", "jobs of this uid", labels=labels)
    held = GaugeMetricFamily("shmloaderd_uid_bytes", "bytes its jobs hold", labels=labels)
    budget = GaugeMetricFamily("shmloaderd_uid_budget_bytes", "uid budget", labels=labels)
    segs = CounterMetricFamily("shmloaderd_uid_reaped_segments", "segments reaped", labels=labels)
    nbytes = CounterMetricFamily("shmloaderd_uid_reaped_bytes", "bytes reaped", labels=labels)
    adm = CounterMetricFamily(
        "shmloaderd_uid_admissions", "admit answers", labels=[*labels, "result"]
    )
    over = GaugeMetricFamily(
        "shmloaderd_uid_over_budget", "1: its jobs hold more than its budget", labels=labels
    )
    refusals = CounterMetricFamily(
        "shmloaderd_uid_refusals", "admissions refused, by reason", labels=[*labels, "reason"]
    )
    for uid, row in sorted(uids.items()):
        key = [uid, str(row.get("user") or uid)]
        jobs.add_metric(key, row["jobs"])
        held.add_metric(key, row["bytes"])
        if row.get("budget_bytes") is not None:
            budget.add_metric(key, row["budget_bytes"])
        segs.add_metric(key, row["reaped_segments"])
        nbytes.add_metric(key, row["reaped_bytes"])
        adm.add_metric([*key, "granted"], row["admissions_granted"])
        adm.add_metric([*key, "refused"], row["admissions_refused"])
        if row.get("budget_bytes") is not None:
            over.add_metric(key, int(bool(row.get("over_budget"))))
        for reason, n in sorted((row.get("refusals") or {}).items()):
            refusals.add_metric([*key, reason], n)
    yield from (jobs, held, budget, segs, nbytes, adm, over, refusals)


def sample_names(snapshot: dict[str, Any]) -> set[str]:
    """Every sample name a scrape shows for ``snapshot`` (a counter's total, a
    histogram's buckets, sum and count), also of families without samples."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for family in _Collector(lambda: snapshot).collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + x for x in suffixes.get(family.type, ("",))}
    return names


class MetricsServer:
    """The HTTP exposition endpoint on ``addr``:``port``; ``close()`` stops it."""

    def __init__(
        self, port: int, snapshot: Callable[[], dict[str, Any]], addr: str = "127.0.0.1"
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(snapshot))
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.addr = addr
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=1)
