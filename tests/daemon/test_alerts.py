"""systemd/alerts.yml: valid Prometheus rules over metrics the daemon exports.

Every metric name an alert's expression uses must be one a scrape of the daemon
can show (``shmloaderd.metrics.sample_names``), or Prometheus's own ``up``: a
renamed metric, or a typo, makes an alert that never fires.
"""

from __future__ import annotations

import os
import re

import pytest
from shmloaderd.metrics import sample_names

from shmloader._node.inventory import build_document

yaml = pytest.importorskip("yaml", reason="pyyaml loads systemd/alerts.yml")

pytestmark = pytest.mark.timeout(30)

ALERTS = os.path.join(os.path.dirname(__file__), "..", "..", "systemd", "alerts.yml")
#: What an expression may name besides the daemon's metrics: Prometheus's scrape health.
PROMETHEUS_OWN = {"up"}
#: PromQL's functions, aggregations and keywords (what an identifier may be besides a metric).
PROMQL = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bool", "by", "ceil",
    "changes", "clamp_min", "count", "count_over_time", "delta", "deriv", "floor",
    "group_left", "group_right", "histogram_quantile", "idelta", "ignoring", "increase",
    "irate", "label_replace", "max", "max_over_time", "min", "min_over_time", "offset", "on",
    "or", "and", "unless", "predict_linear", "rate", "resets", "round", "sum", "sum_over_time",
    "time", "topk", "bottomk", "vector", "without",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers left once label matchers,
    strings, ranges, grouping lists, numbers and PromQL's own words are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL}


def _snapshot() -> dict:
    """A stats snapshot with a job, a rank and a uid row: every family has samples."""
    doc = build_document([], "daemon")
    doc["daemon"] = {"budget_bytes": 1, "in_use_bytes": 0, "pool_bytes": 0, "uids": {
        "1001": {"user": "alice", "jobs": 1, "bytes": 2, "budget_bytes": 1,
                 "reaped_segments": 0, "reaped_bytes": 0, "admissions_granted": 1,
                 "admissions_refused": 1, "over_budget": True, "over_budget_bytes": 1,
                 "refusals": {"uid_budget": 1}, "last_refusal": None}}}  # fmt: skip
    counters = {"reaped_segments": 0, "reaped_bytes": 0, "reaped_sockets": 0,
                "reap_failures": 0, "granted": 1, "refused": 1,
                "requests": {"admit": 2}}  # fmt: skip
    return {"stats": doc, "counters": counters, "waits": []}


def test_every_alert_names_only_metrics_the_daemon_exports() -> None:
    with open(ALERTS) as f:
        rules = yaml.safe_load(f)
    exported = sample_names(_snapshot())
    assert {"shmloaderd_up", "shmloaderd_build_info", "shmloaderd_uid_over_budget"} <= exported
    assert "shmloaderd_uid_refusals_total" in exported
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    names = {r["alert"] for r in alerts}
    assert {
        "ShmloaderdDown",
        "ShmloaderdUidOverBudget",
        "ShmloaderdRefusals",
        "ShmloaderdReapFailures",
        "ShmloaderdShmNearlyFull",
    } <= names
    for rule in alerts:
        used = metric_names(rule["expr"])
        assert used, rule
        unknown = used - exported - PROMETHEUS_OWN
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} are not exported"
        assert rule["annotations"]["summary"], rule


def test_the_name_check_sees_what_an_expression_names() -> None:
    assert metric_names('increase(shmloaderd_uid_refusals_total{reason="x"}[15m]) > 0') == {
        "shmloaderd_uid_refusals_total"
    }
    assert metric_names("sum by (uid) (a_b) / on(instance) c < 0.1") == {"a_b", "c"}
    assert metric_names('up{job="shmloaderd"} == 0') == {"up"}
