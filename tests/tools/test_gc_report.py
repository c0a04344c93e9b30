"""``shmloader gc``'s human report: one line per job, by the name ``stat`` shows."""

from __future__ import annotations

from typing import Any

from shmloader.tools.stat import gc_lines


def _item(kind: str, name: str, token: str, pid: int, size: int, job: str | None) -> dict[str, Any]:
    segment = kind == "segment"
    return {"type": kind, "name": name, "bytes": size, "kind": "data" if segment else "",
            "token": token, "owner_pid": pid, "removed": True, "job": job}  # fmt: skip


ITEMS = [
    _item("segment", "/shml-aa-ctl", "aa", 7, 4096, "llama-sp4"),
    _item("segment", "/shml-bb-0.0", "bb", 9, 1 << 20, None),
    _item("segment", "/shml-aa-0.0", "aa", 7, 1 << 20, "llama-sp4"),
    _item("segment", "/shml-aa-0.1.w1", "aa", 8, 1 << 20, "llama-sp4"),
    _item("socket", "/tmp/shmloader-0/aa-7.sock", "aa", 7, 0, "llama-sp4"),
    _item("rundir", "/tmp/shmloader-0-7-x", "", 7, 0, None),
]


def test_one_line_per_job_by_its_name_then_each_socket_and_directory() -> None:
    assert gc_lines(ITEMS, dry_run=False) == [
        "removed job llama-sp4 (ring aa): 3 segment(s), 2.0 MiB; owner pids 7, 8 are gone",
        "removed ring bb (no job name): 1 segment(s), 1.0 MiB; owner pid 9 is gone",
        "removed stale socket /tmp/shmloader-0/aa-7.sock: owner pid 7 is gone",
        "removed runtime directory /tmp/shmloader-0-7-x: owner pid 7 is gone",
    ]


def test_verbose_lists_each_segment_under_its_job() -> None:
    lines = gc_lines(ITEMS[:4], dry_run=True, verbose=True)
    assert lines[0].startswith("would remove job llama-sp4 (ring aa): 3 segment(s)")
    assert lines[1:4] == [
        "    would remove /shml-aa-ctl (data, 4.0 KiB): owner pid 7 is gone",
        "    would remove /shml-aa-0.0 (data, 1.0 MiB): owner pid 7 is gone",
        "    would remove /shml-aa-0.1.w1 (data, 1.0 MiB): owner pid 8 is gone",
    ]
    assert lines[4].startswith("would remove ring bb (no job name): 1 segment(s)")
