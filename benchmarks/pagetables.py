"""What one batch view costs in page tables, on ``/dev/shm`` and on a huge-page tmpfs.

``python -m benchmarks.pagetables [--mib 256] [--reps 7] [--out DIR]``: a file of
``--mib`` MiB in each directory, written once; then ``--reps`` times, each step
timed alone, what every rank does per delivered batch on its producer and unmap
threads (NOTE [unmapped off the step] in ``shmloader._node.unmap``)::

    mmap      a private (copy-on-write) mapping of the whole file, as a batch view
    populate  madvise(MADV_POPULATE_READ): every page mapped before the user reads
    munmap    the view dropped

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

from . import hugedir, provenance

MiB = 1 << 20
MADV_POPULATE_READ = 22

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
STEPS = ("mmap", "populate", "munmap")


def _checked(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def views(directory: str, nbytes: int, reps: int) -> dict[str, list[float]]:
    """Milliseconds of each step of ``reps`` views of an ``nbytes`` file in ``directory``."""
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
        return times
    finally:
        os.close(fd)
        os.unlink(path)


def markdown(result: dict[str, Any]) -> str:
    lines = [*provenance.header(result["provenance"]), ""]
    lines += [
        f"One {result['mib']:g} MiB file per directory; {result['reps']} views, each step "
        "timed alone (ms; p50, and min-max).",
        "",
        "| directory | pages | mmap | populate | munmap | populate + munmap |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        cells = [f"{row[s + '_p50']:.2f} ({min(row[s]):.2f}-{max(row[s]):.2f})" for s in STEPS]
        both = row["populate_p50"] + row["munmap_p50"]
        lines.append(f"| {row['directory']} | {row['pages']} | {' | '.join(cells)} | {both:.2f} |")
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
            times = views(directory, nbytes, args.reps)
            pages = "2 MiB" if directory == huge else "4 KiB"
            row: dict[str, Any] = {"directory": name, "pages": pages, **times}
            row |= {f"{s}_p50": statistics.median(times[s]) for s in STEPS}
            result["rows"].append(row)
            print(
                f"{name}: populate {row['populate_p50']:.2f} ms, munmap "
                f"{row['munmap_p50']:.2f} ms per {args.mib:g} MiB view",
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
