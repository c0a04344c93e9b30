"""Combine the ranks' measurements into rows, target verdicts, Markdown and plots.

Every number in a row (``aggregate``) and what it means:

- ``follower_ms_p50/p99``: phase A, follower time to a usable batch
  (``next()`` or receive on a rank other than the leader, started after a
  barrier that the leader enters with the batch ready), percentiles over
  every measured step of every follower.
- ``read_ms_p50``: a follower reading every byte of that batch once, right
  after (page faults of a fresh mapping show here, not above; odd steps).
- ``touch_ms_p50``: a follower touching every page of that batch once (one
  byte per page: the page faults alone; even steps).
- ``drop_ms_p50``: a follower dropping its previous batch once it holds the
  new one, as ``for batch in loader`` does (shmloader: unmapping it).
- ``publish_ms_p50``: the leader's publish. shmloader: ``stats()``
  ``publish_ms_total`` per batch (slot acquire + payload write + announce);
  broadcast / objlist: the leader's ``broadcast_object_list`` plus
  ``broadcast`` calls. ``write_ms_p50``: shmloader's ``write_ms_last``.
  ``overhead_ms_p50``: everything ShmLoader adds on the leader, from its
  loader handing over the batch to ``next()`` returning (encode included).
- ``memcpy_cold_ms`` / ``memcpy_warm_ms``: ``np.copyto`` of the same tensors
  into a pre-touched buffer, source freshly handed over by the loader /
  source already mapped (the physical floor of the leader's one write),
  measured by the shmloader leader on every other phase-A step, interleaved
  with the publishes it is compared with. ``publish_ms_p50`` comes from the
  other steps (source as the loader handed it over, like ``memcpy_cold``);
  ``publish_warm_ms_p50`` is the publish right after a floor measurement
  (source warm, like ``memcpy_warm``).
- ``build_ms_p50``: the loading rank's DataLoader worker writing the batch
  (the transport workload's collate, which allocates like ``default_collate``):
  into fresh shared memory for the base ways, into its ring slot for the
  zero-copy way (NOTE [collate into the slot] in ``shmloader._workers.collate``).
  ``worker_write_ms_p50``: what the zero-copy worker copied after that (the
  leaves its collate did not make in the slot).
- ``e2e_ms_p50/p99``: phase B, from the leader's loader handing over the batch
  (publish or send starts) to the last follower holding it, followers
  already waiting.
- ``steps_per_s``: phase B steps (transport) or training-loop steps
  (realistic) per second of wall time.
- ``cpu_s``: user + system CPU seconds of every rank and its DataLoader
  workers, from before the loader is made to after it is closed.
- ``node_mem_mib``: peak over samples of sum(PSS - PSS_shmem) over every rank
  and worker plus the growth of ``/dev/shm`` usage; ``batch_mem_mib``: the
  same minus the ranks' PSS before the loader was made (memory for batches,
  loaders and workers); ``shm_mib``: the ``/dev/shm`` growth alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import provenance

MiB = 1 << 20
LABELS = {
    "base": "base (every rank loads)",
    "broadcast": "broadcast (meta pickled, tensors broadcast)",
    "objlist": "broadcast_object_list (whole batch pickled)",
    "shmloader": "shmloader (workers write the ring: zero-copy)",
    "shmloader-1copy": "shmloader, leader copies (one copy)",
    "shmloader-huge": "shmloader, ring in a huge=within_size tmpfs (2 MiB pages)",
}


def _pct(values: list[float], q: float) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def _field(ranks: list[dict], phase: str, key: str, *, leader: bool) -> list[float]:
    return [
        rec[key]
        for r in ranks
        if (r["rank"] == 0) == leader
        for rec in r["records"].get(phase, [])
        if rec.get(key) is not None
    ]


def _e2e(ranks: list[dict]) -> list[float]:
    """Per phase-B step: last follower's hold time minus the leader's start."""
    leader = ranks[0]["records"].get("B", [])
    followers = [r["records"].get("B", []) for r in ranks[1:]]
    out = []
    for j, rec in enumerate(leader):
        holds = [f[j].get("hold_ns") for f in followers if j < len(f)]
        if rec.get("start_ns") and holds and None not in holds:
            out.append((max(holds) - rec["start_ns"]) / 1e6)
    return out


def _memory(ranks: list[dict]) -> dict[str, float | None]:
    """Node memory at the worst sample, and its growth over the start."""
    n = min((len(r["memory_samples"]) for r in ranks), default=0)
    if n == 0:
        return {"node_mem_mib": None, "batch_mem_mib": None, "shm_mib": None}
    start_private = sum(r["memory_start"]["pss"] - r["memory_start"]["pss_shmem"] for r in ranks)
    shm_start = ranks[0]["memory_start"]["shm_used"]
    best = None
    for k in range(n):
        private = sum(
            r["memory_samples"][k]["pss"] - r["memory_samples"][k]["pss_shmem"] for r in ranks
        )
        shm = max(ranks[0]["memory_samples"][k]["shm_used"] - shm_start, 0)
        if best is None or private + shm > best[0] + best[1]:
            best = (private, shm)
    assert best is not None
    return {
        "node_mem_mib": (best[0] + best[1]) / MiB,
        "batch_mem_mib": (best[0] + best[1] - start_private) / MiB,
        "shm_mib": best[1] / MiB,
    }


def aggregate(case: dict[str, Any], ranks: list[dict]) -> dict[str, Any]:
    """One row of results from every rank's JSON (see the module doc for each key)."""
    leader = ranks[0]
    row: dict[str, Any] = {
        "run": case["run"],
        "mode": case["mode"],
        "sp": case["sp"],
        "target_mib": case["target_bytes"] / MiB,
        "payload_mib": leader.get("payload_bytes", 0) / MiB,
        "steps": case["steps"],
        "workers": case["workers"],
        "cpu_s": sum(r["cpu_s"] or 0.0 for r in ranks),
        **_memory(ranks),
    }
    if case["run"] in ("realistic", "budget"):
        waits = [rec["wait_ms"] for r in ranks[1:] for rec in r["records"].get("R", [])]
        row["wait_ms_p50"] = _pct(waits, 50)
        row["steps_per_s"] = case["steps"] / leader["loop_s"] if leader.get("loop_s") else None
        return row
    follow = _field(ranks, "A", "follower_ms", leader=False)
    e2e = _e2e(ranks)
    row.update(
        {
            "follower_ms_p50": _pct(follow, 50),
            "follower_ms_p99": _pct(follow, 99),
            "follower_ms_max": max(follow) if follow else None,
            "follower_n": len(follow),
            "read_ms_p50": _pct(_field(ranks, "A", "read_ms", leader=False), 50),
            "touch_ms_p50": _pct(_field(ranks, "A", "touch_ms", leader=False), 50),
            "drop_ms_p50": _pct(_field(ranks, "A", "drop_ms", leader=False), 50),
            "publish_ms_p50": _pct(_field(ranks, "A", "publish_ms", leader=True), 50),
            "write_ms_p50": _pct(_field(ranks, "A", "write_ms", leader=True), 50),
            "overhead_ms_p50": _pct(_field(ranks, "A", "overhead_ms", leader=True), 50),
            "meta_ms_p50": _pct(_field(ranks, "A", "meta_ms", leader=True), 50),
            "tensor_ms_p50": _pct(_field(ranks, "A", "tensor_ms", leader=True), 50),
            "receive_ms_p50": _pct(_field(ranks, "A", "receive_ms", leader=False), 50),
            "publish_warm_ms_p50": _pct(_field(ranks, "A", "publish_warm_ms", leader=True), 50),
            "memcpy_cold_ms": _pct(_field(ranks, "A", "memcpy_cold_ms", leader=True), 50),
            "memcpy_warm_ms": _pct(_field(ranks, "A", "memcpy_warm_ms", leader=True), 50),
            "worker_write_ms_p50": _pct(_field(ranks, "A", "worker_write_ms", leader=True), 50),
            "build_ms_p50": _pct(
                _field(ranks, "A", "build_ms", leader=True)
                + _field(ranks, "B", "build_ms", leader=True),
                50,
            ),
            "main_ms_p50": _pct(
                _field(ranks, "A", "main_ms", leader=True)
                + _field(ranks, "B", "main_ms", leader=True),
                50,
            ),
            "e2e_ms_p50": _pct(e2e, 50),
            "e2e_ms_p99": _pct(e2e, 99),
            "steps_per_s": case["steps"] / leader["phase_b_s"] if leader.get("phase_b_s") else None,
            "ring_slots": (leader.get("loader_stats") or {}).get("ring_slots"),
        }
    )
    return row


# ------------------------------------------------------------------ targets


def _find(rows: list[dict], **want: Any) -> dict | None:
    for row in rows:
        if all(
            math.isclose(row.get(k), v) if isinstance(v, float) else row.get(k) == v
            for k, v in want.items()
        ):
            return row
    return None


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "MISSED")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _fmt(x: float | None, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}{unit}"
    return f"{x:.{digits}f}{unit}"


#: Summed CPU of the realistic run against base, at SP4; at other SPs the
#: same margin over the floor (one loading rank instead of SP: 1/SP of base).
CPU_TARGET_AT_SP4 = 0.35


def cpu_target(sp: int) -> float:
    """The summed-CPU target at ``sp``: ``CPU_TARGET_AT_SP4`` scaled by 4/SP (1.4/SP)."""
    return CPU_TARGET_AT_SP4 * 4 / sp


def targets(
    rows: list[dict], *, key_mib: float | None = None, key_sp: int | None = None
) -> list[dict]:
    """The design targets this run measured, each with what was measured and met / MISSED.

    Each SP-specific target is reported at ``key_sp``: by default the largest
    SP measured (so ``--sp 8`` alone is measured), and each size-specific one
    at ``key_mib``: 256 MiB when the run has it, else its largest transport
    size. Targets the run did not measure are left out (``measured_only``).
    """
    return measured_only(all_targets(rows, key_mib=key_mib, key_sp=key_sp))


def measured_only(rows: list[dict]) -> list[dict]:
    """Drop the targets nothing of this run measured (verdict or figures missing)."""
    return [t for t in rows if t["verdict"] != "not measured" and not _unmeasured(t)]


def _unmeasured(t: dict) -> bool:
    """An information row whose figures are all missing."""
    return t["verdict"] == "-" and not any(c.isdigit() for c in t["measured"].split(" of ")[0])


def all_targets(
    rows: list[dict], *, key_mib: float | None = None, key_sp: int | None = None
) -> list[dict]:
    """Every design target, measured or not (``not measured`` where the run lacks it)."""
    out: list[dict] = []
    if key_sp is None:
        key_sp = max((r["sp"] for r in rows), default=4)
    if key_mib is None:
        sizes = {r["target_mib"] for r in rows if r["run"] == "transport"}
        key_mib = 256.0 if 256.0 in sizes or not sizes else max(sizes)
    shm = [r for r in rows if r["run"] == "transport" and r["mode"] == "shmloader"]
    p50 = [r["follower_ms_p50"] for r in shm if r.get("follower_ms_p50") is not None]
    p99 = [r["follower_ms_p99"] for r in shm if r.get("follower_ms_p99") is not None]
    spread = None
    if shm:
        small = min(shm, key=lambda r: r["payload_mib"])
        large = max(shm, key=lambda r: r["payload_mib"])
        spread = _ratio(large.get("follower_ms_p50"), small.get("follower_ms_p50"))
    out.append(
        {
            "target": "follower time to a usable batch <= 1 ms, independent of batch size (p50)",
            "measured": f"p50 max {_fmt(max(p50) if p50 else None, 3)} ms over "
            f"{len(p50)} configs; largest/smallest batch {_fmt(spread)}x",
            "verdict": _verdict(
                None if not p50 else max(p50) <= 1.0 and (spread is None or spread <= 2.0)
            ),
        }
    )
    out.append(
        {
            "target": "follower time to a usable batch <= 1 ms (p99)",
            "measured": f"p99 max {_fmt(max(p99) if p99 else None, 3)} ms",
            "verdict": _verdict(None if not p99 else max(p99) <= 1.0),
        }
    )
    key = _find(shm, sp=key_sp, target_mib=key_mib)
    out += _zero_copy_targets(rows, key, key_sp, key_mib)
    one = _find(rows, run="transport", mode="shmloader-1copy", sp=key_sp, target_mib=key_mib)
    for pub_key, floor_key, what in (
        ("publish_ms_p50", "memcpy_cold_ms", "source as handed over by the loader"),
        ("publish_warm_ms_p50", "memcpy_warm_ms", "source already mapped"),
    ):
        pub = one.get(pub_key) if one else None
        floor = one.get(floor_key) if one else None
        ratio = _ratio(pub, floor)
        out.append(
            {
                "target": f"one-copy way: leader publish <= 1.2x plain memcpy ({what}), "
                f"SP{key_sp} {key_mib:g} MiB",
                "measured": f"publish {_fmt(pub)} ms / memcpy {_fmt(floor)} ms = {_fmt(ratio)}x",
                "verdict": _verdict(None if ratio is None else ratio <= 1.2),
            }
        )
    mine = key.get("e2e_ms_p50") if key else None
    for mode, factor in (("broadcast", 10.0), ("objlist", 100.0)):
        other = _find(rows, run="transport", mode=mode, sp=key_sp, target_mib=key_mib)
        theirs = other.get("e2e_ms_p50") if other else None
        ratio = _ratio(theirs, mine)
        out.append(
            {
                "target": f"end-to-end SP{key_sp} delivery >= {factor:g}x faster than "
                f"{LABELS[mode]}, {key_mib:g} MiB",
                "measured": f"{_fmt(theirs)} ms vs {_fmt(mine)} ms = {_fmt(ratio, 1)}x",
                "verdict": _verdict(None if ratio is None else ratio >= factor),
            }
        )
    bc = _find(rows, run="transport", mode="broadcast", sp=key_sp, target_mib=key_mib)
    out.append(
        {
            "target": f"(information) broadcast_object_list of the metadata only, SP{key_sp} "
            f"{key_mib:g} MiB",
            "measured": f"{_fmt(bc.get('meta_ms_p50') if bc else None)} ms of the broadcast way's "
            f"{_fmt(bc.get('publish_ms_p50') if bc else None)} ms publish",
            "verdict": "-",
        }
    )
    for run, mib in (("transport", key_mib), ("realistic", None)):
        for sp in sorted({r["sp"] for r in rows}):
            want = {"run": run, "sp": sp} | ({"target_mib": mib} if mib else {})
            base = _find(rows, mode="base", **want)
            mine_row = _find(rows, mode="shmloader", **want)
            ratio = _ratio(
                mine_row.get("batch_mem_mib") if mine_row else None,
                base.get("batch_mem_mib") if base else None,
            )
            where = f"{run} SP{sp}" + (f" {mib:g} MiB" if mib else "")
            out.append(
                {
                    "target": f"node memory for batches ~ 1/SP of base (<= 1.25/SP), {where}",
                    "measured": f"{_fmt(mine_row.get('batch_mem_mib') if mine_row else None, 0)}"
                    f" / {_fmt(base.get('batch_mem_mib') if base else None, 0)} MiB = "
                    f"{_fmt(ratio)}x (1/SP = {1 / sp:.2f})",
                    "verdict": _verdict(None if ratio is None else ratio <= 1.25 / sp),
                }
            )
    for sp in sorted({r["sp"] for r in rows if r["run"] == "budget"}):
        base = _find(rows, run="budget", mode="base", sp=sp)
        mine_row = _find(rows, run="budget", mode="shmloader", sp=sp)
        theirs = base.get("steps_per_s") if base else None
        mine = mine_row.get("steps_per_s") if mine_row else None
        out.append(
            {
                "target": f"(information) equal CPU budget, SP{sp}: steps/s with SP x w workers "
                "on the loading rank vs w on every base rank",
                "measured": f"{_fmt(mine)} vs {_fmt(theirs)} steps/s = "
                f"{_fmt(_ratio(mine, theirs))}x",
                "verdict": "-",
            }
        )
    base = _find(rows, run="realistic", mode="base", sp=key_sp)
    mine_row = _find(rows, run="realistic", mode="shmloader", sp=key_sp)
    ratio = _ratio(mine_row.get("cpu_s") if mine_row else None, base.get("cpu_s") if base else None)
    goal = cpu_target(key_sp)
    out.append(
        {
            "target": f"summed CPU time at SP{key_sp} <= {goal:.2f}x base (1.4/SP: 0.35x at "
            "SP4; realistic workers)",
            "measured": f"{_fmt(mine_row.get('cpu_s') if mine_row else None)} s / "
            f"{_fmt(base.get('cpu_s') if base else None)} s = {_fmt(ratio)}x "
            f"(1/SP = {1 / key_sp:.2f})",
            "verdict": _verdict(None if ratio is None else ratio <= goal),
        }
    )
    return out


def _zero_copy_targets(rows: list[dict], key: dict | None, sp: int, mib: float) -> list[dict]:
    """The zero-copy way's targets (workers write the ring)."""
    shm = [r for r in rows if r["run"] == "transport" and r["mode"] == "shmloader"]
    main = [r["main_ms_p50"] for r in shm if r.get("main_ms_p50") is not None]
    at_key = key.get("main_ms_p50") if key else None
    out = [
        {
            "target": f"zero-copy: leader main-process time per batch <= 1 ms at {mib:g} MiB, "
            "independent of size (p50: adopt, announce, own view, decode; waits for "
            "readers left out)",
            "measured": f"{_fmt(at_key, 3)} ms at SP{sp} {mib:g} MiB; "
            f"{_fmt(min(main) if main else None, 3)}-{_fmt(max(main) if main else None, 3)} ms "
            f"over {len(main)} configs",
            "verdict": _verdict(None if at_key is None else at_key <= 1.0),
        }
    ]
    for s in sorted({r["sp"] for r in shm}):
        row = _find(shm, sp=s, target_mib=mib)
        bc = _find(rows, run="transport", mode="broadcast", sp=s, target_mib=mib)
        theirs, mine = (bc or {}).get("e2e_ms_p50"), (row or {}).get("e2e_ms_p50")
        ratio = _ratio(theirs, mine)
        out.append(
            {
                "target": f"zero-copy: end-to-end SP{s} delivery >= 30x faster than the tensor "
                f"broadcast, {mib:g} MiB",
                "measured": f"{_fmt(theirs)} ms vs {_fmt(mine)} ms = {_fmt(ratio, 1)}x",
                "verdict": _verdict(None if ratio is None else ratio >= 30.0),
            }
        )
    build = key.get("build_ms_p50") if key else None
    copy = key.get("worker_write_ms_p50") if key else None
    write = None if build is None else build + (copy or 0.0)
    floor = key.get("memcpy_warm_ms") if key else None
    base = _find(rows, run="transport", mode="base", sp=sp, target_mib=mib)
    fresh = (base or {}).get("build_ms_p50")
    speed = _ratio(floor, write)
    out.append(
        {
            "target": f"zero-copy: a worker's write into its slot >= 0.8x memcpy speed, "
            f"SP{sp} {mib:g} MiB",
            "measured": f"write {_fmt(write)} ms (collate into the slot {_fmt(build)} + copied "
            f"after {_fmt(copy)}) vs memcpy {_fmt(floor)} ms = {_fmt(speed)}x memcpy speed; "
            f"the base worker's write into fresh shared memory: {_fmt(fresh)} ms",
            "verdict": _verdict(None if speed is None else speed >= 0.8),
        }
    )
    return out


# ----------------------------------------------------------------- markdown


TRANSPORT_COLUMNS = (
    ("SP", "sp", 0),
    ("way", "mode", None),
    ("MiB", "payload_mib", 1),
    ("follower p50 ms", "follower_ms_p50", 3),
    ("follower p99 ms", "follower_ms_p99", 3),
    ("follower touch-pages ms", "touch_ms_p50", 2),
    ("follower read ms", "read_ms_p50", 2),
    ("follower drop-previous ms", "drop_ms_p50", 2),
    ("leader publish ms", "publish_ms_p50", 2),
    ("publish, warm source ms", "publish_warm_ms_p50", 2),
    ("shmloader overhead ms", "overhead_ms_p50", 2),
    ("worker build ms", "build_ms_p50", 2),
    ("worker write ms", "worker_write_ms_p50", 2),
    ("leader main-process ms", "main_ms_p50", 3),
    ("memcpy cold/warm ms", None, 2),
    ("e2e p50 ms", "e2e_ms_p50", 2),
    ("e2e p99 ms", "e2e_ms_p99", 2),
    ("steps/s", "steps_per_s", 2),
    ("CPU s", "cpu_s", 2),
    ("node mem MiB", "node_mem_mib", 0),
    ("batch mem MiB", "batch_mem_mib", 0),
    ("/dev/shm MiB", "shm_mib", 0),
    ("load", "loadavg_1m", 1),
)
REALISTIC_COLUMNS = (
    ("SP", "sp", 0),
    ("way", "mode", None),
    ("MiB", "payload_mib", 1),
    ("workers", "workers", 0),
    ("follower wait p50 ms", "wait_ms_p50", 2),
    ("steps/s", "steps_per_s", 2),
    ("CPU s", "cpu_s", 2),
    ("CPU vs base", "cpu_vs_base", 2),
    ("node mem MiB", "node_mem_mib", 0),
    ("batch mem MiB", "batch_mem_mib", 0),
    ("batch mem vs base", "mem_vs_base", 2),
    ("/dev/shm MiB", "shm_mib", 0),
    ("load", "loadavg_1m", 1),
)


def _cell(row: dict, key: str | None, digits: int | None) -> str:
    if key is None:
        cold, warm = row.get("memcpy_cold_ms"), row.get("memcpy_warm_ms")
        return "-" if cold is None else f"{_fmt(cold)} / {_fmt(warm)}"
    value = row.get(key)
    if digits is None or isinstance(value, str):
        return str(value)
    if digits == 0 and value is not None:
        return f"{value:.0f}"
    return _fmt(value, digits)


def _table(rows: list[dict], columns: tuple) -> list[str]:
    lines = [
        "| " + " | ".join(c[0] for c in columns) + " |",
        "|" + "|".join(" --- " for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, c[1], c[2]) for c in columns) + " |")
    return lines


def _relative(rows: list[dict]) -> list[dict]:
    """Realistic rows with CPU and memory relative to base at the same SP."""
    out = []
    for row in rows:
        base = _find(rows, mode="base", sp=row["sp"])
        out.append(
            {
                **row,
                "cpu_vs_base": _ratio(row.get("cpu_s"), base.get("cpu_s") if base else None),
                "mem_vs_base": _ratio(
                    row.get("batch_mem_mib"), base.get("batch_mem_mib") if base else None
                ),
            }
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    """``results.md``: machine, targets, transport table, realistic table, skips."""
    m = result["machine"]
    rows = result["rows"]
    load = m.get("loadavg_start", [0, 0, 0]), m.get("loadavg_end", [0, 0, 0])
    lines = [
        "# shmloader benchmark results",
        "",
        *(
            provenance.header(result["provenance"])
            if "provenance" in result
            else [f"Command: `{result['command']}` ({result['wall_s']:.0f} s)."]
        ),
        "",
        f"Machine: {m['cores']} cores ({m['cpu_model']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"{m['shm_bytes'] / 2**30:.1f} GiB /dev/shm, Linux {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}. Load average at start {load[0][0]:.2f}, at end {load[1][0]:.2f} "
        f"(1 min); highest seen before a configuration {result['loadavg_max']:.2f}.",
    ]
    lib = m.get("shmloader") or {}
    if lib:
        dirty = " plus uncommitted changes" if lib.get("uncommitted_library_changes") else ""
        where = f"git {lib['git_head']}{dirty}" if "git_head" in lib else lib.get("origin", "?")
        lines += [
            "",
            f"shmloader measured: {where}, sources sha256 {lib.get('sources_sha256')} "
            f"(`{lib.get('path')}`).",
        ]
    if result["loadavg_max"] > 0.5 * m["cores"]:
        lines += [
            "",
            "**Shared machine:** other work was running (load average up to "
            f"{result['loadavg_max']:.2f} on {m['cores']} cores); absolute times are "
            "pessimistic and noisy, ratios between the ways run back to back are more robust.",
        ]
    lines += ["", "## Targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {t['verdict']} |" for t in result["targets"]]
    lines += [
        "",
        "Only the targets this run measured are listed; each SP-specific one at the "
        "largest SP measured.",
    ]
    transport = [r for r in rows if r["run"] == "transport"]
    realistic = _relative([r for r in rows if r["run"] == "realistic"])
    budget = _relative([r for r in rows if r["run"] == "budget"])
    if transport:
        workers = sorted({r["workers"] for r in transport})
        lines += ["", f"## Transport (templated batches, {workers} DataLoader worker(s))", ""]
        lines += _table(transport, TRANSPORT_COLUMNS)
    if realistic:
        lines += ["", "## Realistic workers (decode-like CPU work per sample)", ""]
        lines += _table(realistic, REALISTIC_COLUMNS)
    if budget:
        lines += [
            "",
            "## Equal CPU budget (realistic workload; base: w workers per rank, "
            "shmloader: SP x w on the loading rank)",
            "",
        ]
        lines += _table(budget, REALISTIC_COLUMNS)
    if result["skipped"] or result["failed"]:
        lines += ["", "## Skipped or failed", ""]
        lines += [f"- skipped {s['label']}: {s['reason']}" for s in result["skipped"]]
        lines += [f"- FAILED {s['label']}: {s['reason']}" for s in result["failed"]]
    lines += ["", "Plot: `delivery.png` (follower time to a usable batch), `e2e.png`.", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------- plots


STYLE = {
    "base": ("tab:gray", "s", "-"),
    "broadcast": ("tab:orange", "^", "-"),
    "objlist": ("tab:red", "v", "--"),
    "shmloader": ("tab:blue", "o", "-"),
    "shmloader-1copy": ("tab:cyan", "D", "--"),
}


def _size_ticks(ax: Any, sizes: list[float]) -> None:
    """Label the x axis at the measured batch sizes only, in plain numbers.

    Matplotlib's default log axis labels minor ticks (3x10^1, 4x10^1) when a
    panel spans less than a decade or two, and those labels overlap.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    if not sizes:
        return
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda v, _pos: f"{v:.0f}" if v >= 10 else f"{v:.2g}")
    )
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot(rows: list[dict], path: str, key: str, ylabel: str, title: str) -> None:
    """One log-log panel per SP size: ``key`` (p50, p99 as a thin line) vs batch MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transport = [r for r in rows if r["run"] == "transport" and r.get(key) is not None]
    sps = sorted({r["sp"] for r in transport}) or [0]
    fig, axes = plt.subplots(1, len(sps), figsize=(6 * len(sps), 4.5), squeeze=False)
    p99 = key.replace("p50", "p99")
    for ax, sp in zip(axes[0], sps, strict=True):
        for mode, (color, marker, line) in STYLE.items():
            pts = sorted(
                (r["payload_mib"], r[key], r.get(p99))
                for r in transport
                if r["sp"] == sp and r["mode"] == mode
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], line, color=color, marker=marker, label=LABELS[mode])
            if all(p[2] is not None for p in pts):
                ax.plot(xs, [p[2] for p in pts], ":", color=color, linewidth=0.8)
        if key.startswith("follower"):
            ax.axhline(1.0, color="green", linewidth=0.8, linestyle="--", label="target 1 ms")
        floor = sorted(
            (r["payload_mib"], r["memcpy_cold_ms"])
            for r in transport
            if r["sp"] == sp and r.get("memcpy_cold_ms") is not None
        )
        if key.startswith("e2e") and floor:
            ax.plot(
                [f[0] for f in floor],
                [f[1] for f in floor],
                "--",
                color="black",
                linewidth=0.8,
                label="one memcpy of the payload (leader, cold source)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        _size_ticks(ax, sorted({r["payload_mib"] for r in transport if r["sp"] == sp}))
        ax.set_xlabel("batch payload (MiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, SP{sp}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no transport results", ha="center", transform=ax.transAxes)
    fig.text(0.01, 0.01, "solid: p50, dotted: p99", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
