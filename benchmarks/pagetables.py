"""What one batch view costs in page tables, on ``/dev/shm`` and on a huge-page tmpfs.

``python -m benchmarks.pagetables [--mib 256] [--reps 7] [--out DIR]``: a file of
``--mib`` MiB in each directory, written once; then ``--reps`` times, each step
timed alone, what every rank does per delivered batch on its producer and unmap
threads (NOTE [unmapped off the step] in ``shmloader._node.unmap``)::

    mmap      a private (copy-on-write) mapping of the whole file, as a batch view
    populate  madvise(MADV_POPULATE_READ): every page mapped before the user reads
    munmap    the view dropped

and, on a slot's standing mapping (NOTE [a standing mapping] in
``shmloader._node.standing``: one mapping per slot, kept), what a dropped batch
costs instead: its recycle, the pagemap read that finds the pages the user wrote
and the drop of those (``recycle``: none written; ``recycle 1/64``: one page in
64 written).

No rank, ring or loader: the system calls alone, on one thread of an idle
process, so the figures are the CPU those threads spend per view, which a
2-core machine takes from the step. The huge-page tmpfs is mounted in a private
mount namespace (``hugedir.mount``; needs root, else that way is skipped).
Writes ``pagetables.json`` and ``pagetables.md`` to ``--out`` (default a new
temporary directory).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from shmloader._node import standing

from . import hugedir, provenance

MiB = 1 << 20
MADV_POPULATE_READ = 22

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
STEPS = ("mmap", "populate", "munmap")
RECYCLES = ("recycle", "recycle 1/64")


def _checked(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def views(directory: str, nbytes: int, reps: int, recycle: bool) -> dict[str, list[float]]:
    """Milliseconds of each step of ``reps`` views of an ``nbytes`` file in ``directory``;
    ``recycle``: and of a standing mapping's recycles (4 KiB pages: where one is kept)."""
    fd, path = tempfile.mkstemp(prefix="shml-pagetables-", dir=directory)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        chunk = b"\1" * MiB
        for off in range(0, nbytes, MiB):
            os.pwrite(fd, chunk[: nbytes - off], off)
        times: dict[str, list[float]] = {s: [] for s in STEPS}
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE
        for _ in range(reps):
            t0 = time.perf_counter()
            addr = _LIBC.mmap(None, nbytes, prot, flags, fd, 0)
            t1 = time.perf_counter()
            if addr in (None, ctypes.c_void_p(-1).value):
                _checked(-1, "mmap")
            _checked(_LIBC.madvise(addr, nbytes, MADV_POPULATE_READ), "MADV_POPULATE_READ")
            t2 = time.perf_counter()
            _checked(_LIBC.munmap(addr, nbytes), "munmap")
            t3 = time.perf_counter()
            for step, (a, b) in zip(STEPS, ((t0, t1), (t1, t2), (t2, t3)), strict=True):
                times[step].append((b - a) * 1e3)
        if recycle:
            times |= recycles(fd, nbytes, reps)
        return times
    finally:
        os.close(fd)
        os.unlink(path)


def recycles(fd: int, nbytes: int, reps: int) -> dict[str, list[float]]:
    """Milliseconds of ``reps`` recycles of a standing private mapping of ``fd``, with
    nothing written and with one page in 64 written before each."""
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE
    addr = _LIBC.mmap(None, nbytes, prot, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        _checked(-1, "mmap")
    times: dict[str, list[float]] = {s: [] for s in RECYCLES}
    try:
        _checked(_LIBC.madvise(addr, nbytes, MADV_POPULATE_READ), "MADV_POPULATE_READ")
        pages = (ctypes.c_uint8 * nbytes).from_address(addr)
        for _ in range(reps):
            for step, every in zip(RECYCLES, (0, 64), strict=True):
                for off in range(0, nbytes, mmap.PAGESIZE * every) if every else ():
                    pages[off] = 2  # the user's write: a private copy of the page
                t0 = time.perf_counter()
                if not standing._drop_written(addr, nbytes):
                    raise OSError("the recycle of a standing mapping failed (pagemap)")
                times[step].append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        _checked(_LIBC.munmap(addr, nbytes), "munmap")


def markdown(result: dict[str, Any]) -> str:
    lines = [*provenance.header(result["provenance"]), ""]
    lines += [
        f"One {result['mib']:g} MiB file per directory; {result['reps']} views, each step "
        "timed alone (ms; p50, and min-max).",
        "",
        "A batch's own view (mmap, populate, munmap) against a standing mapping's recycle",
        "(NOTE [a standing mapping]: what a dropped batch costs where the slot keeps its",
        "mapping, on 4 KiB pages only; *1/64*: one page in 64 written by the user).",
        "",
        "| directory | pages | mmap | populate | munmap | populate + munmap "
        "| recycle | recycle 1/64 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        cells = [f"{row[s + '_p50']:.2f} ({min(row[s]):.2f}-{max(row[s]):.2f})" for s in STEPS]
        both = row["populate_p50"] + row["munmap_p50"]
        kept = [
            f"{row[s + '_p50']:.2f} ({min(row[s]):.2f}-{max(row[s]):.2f})" if s in row else "-"
            for s in RECYCLES
        ]
        lines.append(
            f"| {row['directory']} | {row['pages']} | {' | '.join(cells)} | {both:.2f} "
            f"| {' | '.join(kept)} |"
        )
    for skip in result["skipped"]:
        lines.append(f"\n{skip['directory']}: skipped, {skip['reason']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.pagetables",
        description="Page-table cost of one batch view on /dev/shm and a huge-page tmpfs.",
    )
    p.add_argument("--mib", type=float, default=256.0, help="file size in MiB (default 256)")
    p.add_argument("--reps", type=int, default=7, help="views per directory")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps < 1:
        p.error("--mib must be > 0 and --reps >= 1")
    out = args.out or tempfile.mkdtemp(prefix="shml-pagetables-")
    os.makedirs(out, exist_ok=True)
    nbytes = int(args.mib * MiB)
    record = provenance.start("benchmarks.pagetables", argv)
    huge, why = hugedir.mount(2 * nbytes)
    result: dict[str, Any] = {"provenance": record, "mib": args.mib, "reps": args.reps}
    result |= {"rows": [], "skipped": []}
    try:
        for name, directory in (("/dev/shm", "/dev/shm"), ("huge-page tmpfs", huge)):
            if directory is None:
                result["skipped"].append({"directory": name, "reason": why})
                continue
            pages = "2 MiB" if directory == huge else "4 KiB"
            times = views(directory, nbytes, args.reps, recycle=directory != huge)
            row: dict[str, Any] = {"directory": name, "pages": pages, **times}
            row |= {f"{s}_p50": statistics.median(times[s]) for s in STEPS + RECYCLES if s in times}
            result["rows"].append(row)
            print(
                f"{name}: populate {row['populate_p50']:.2f} ms, munmap "
                f"{row['munmap_p50']:.2f} ms per {args.mib:g} MiB view; recycle of a "
                f"standing mapping {row.get('recycle_p50', float('nan')):.2f} ms",
                file=sys.stderr,
            )
    finally:
        hugedir.unmount(huge)
    provenance.finish(record)
    for name, text in (
        ("pagetables.json", json.dumps(result, indent=1)),
        ("pagetables.md", markdown(result)),
    ):
        path = os.path.join(out, name)
        with open(path, "w") as fh:
            fh.write(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
