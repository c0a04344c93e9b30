"""Spawn real ranks over gloo on loopback, optionally on simulated nodes.

``run_ranks(fn, world, ...)`` starts ``world`` processes (spawn), initialises
``torch.distributed`` with gloo on 127.0.0.1 in each, calls
``fn(rank, world, **kwargs)`` and returns the per-rank results (anything
``torch.save`` can store). A rank that raised is reported with its traceback;
a run that outlives ``timeout`` is killed and fails the test.

Simulated nodes: ``nodes=[0, 0, 1, 1]`` puts ranks 0-1 on node 0 and 2-3 on
node 1. Every node but node 0 gets its own ``/dev/shm``: the rank enters a
private mount namespace and bind-mounts a per-node tmpfs over ``/dev/shm``,
so ranks of different nodes really cannot map each other's segments (as on
two hosts or two containers), and ``SHMLOADER_NODE`` is set to the node id.

NOTE [warm ranks]
    A rank is a real process (its own pid, signals, death, mount namespace),
    but it does not pay torch's import: ``run_ranks`` forks it from a
    forkserver that imported ``WARM_MODULES`` once (torch, torch.distributed,
    numpy, zmq, and pytest: every rank imports a test module, and test modules
    import pytest, 0.13 s of CPU a rank), about 50 ms a rank instead of 2-5 s
    of a cold interpreter on 2 cores. What a fork would carry over from the server is given anew to
    every rank: the test's whole environment (``os.environ`` as it is at the
    call, plus the rank's variables), its process group (a fresh TCPStore and
    gloo group per run), its ring directory and node namespace. shmloader and
    the test's own modules are not preloaded: shmloader reads
    ``SHMLOADER_SHM_DIR`` and ``SHMLOADER_HEADER_SIZE`` at import, so every
    rank imports it after its environment is set, and before it forks its
    DataLoader workers' forkserver (``_fork_worker_server``), so its workers
    start with both imported, not importing them again each (about 1 s a
    worker on 2 busy cores, paid per epoch). The server is restarted
    when the pytest process has entered another mount namespace since it
    started (``huge_dir``), so ranks always see the mounts the test sees.
    ``cold=True`` starts cold interpreters (spawn) instead, for tests whose
    subject is a fresh process (what importing the package does).
    ``preload=[...]``: modules a test's ranks all import that cost seconds
    each (Lightning): its ranks come from a second warm server that imported
    ``WARM_MODULES`` and those too, started once per pytest process and kept
    (``_preloaded_server``); other tests' ranks never see them.
    ``SHMLOADER_TEST_COLD_RANKS=1`` in the pytest process's environment makes
    every rank cold (``cold_ranks``), as ranks were started before the warm
    launcher: ``tests/mutation_check.py`` runs its tests both ways to show
    that the warm launcher catches the same bugs.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

CLONE_NEWNS = 0x00020000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _enter_private_shm(shm_dir: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(shm_dir.encode(), b"/dev/shm", None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind {shm_dir} over /dev/shm")


def huge_tmpfs(size: str = "1g") -> str:
    """Mount a tmpfs with ``huge=within_size`` (mode 1777) in a private mount namespace.

    This thread (the main one) enters a new mount namespace first, with every
    mount private, so the tmpfs is seen only by this process and what it
    starts from now on, and goes away with them. Returns its path; ``OSError``
    when not root or the kernel refuses.
    """
    if os.geteuid() != 0:
        raise OSError(1, "not root")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    path = tempfile.mkdtemp(prefix="shml-huge-")
    options = f"huge=within_size,size={size},mode=1777".encode()
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options) != 0:
        err = ctypes.get_errno()
        os.rmdir(path)
        raise OSError(err, f"mount -t tmpfs -o {options.decode()} tmpfs {path}")
    return path


#: What the warm forkserver imports once (NOTE [warm ranks]); never shmloader.
WARM_MODULES = ["torch", "torch.distributed", "torch.utils.data", "numpy", "zmq", "pytest"]
_warm_ns: list[str] = []  # the mount namespace the running forkserver was started in


def _mount_ns() -> str:
    return os.readlink("/proc/self/ns/mnt")


def cold_ranks(cold: bool = False) -> bool:
    """Whether ranks start cold: asked, or ``SHMLOADER_TEST_COLD_RANKS=1`` (NOTE [warm ranks])."""
    return cold or os.environ.get("SHMLOADER_TEST_COLD_RANKS") == "1"


def rank_context(cold: bool = False) -> Any:
    """The multiprocessing context ranks start from (NOTE [warm ranks])."""
    if cold_ranks(cold):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if _warm_ns and _warm_ns[0] != _mount_ns():
        server._stop()  # started outside the namespace this process is in now
        _warm_ns.clear()
    if not _warm_ns:
        mp.set_forkserver_preload(WARM_MODULES)
        server.ensure_running()
        _warm_ns.append(_mount_ns())
    return mp.get_context("forkserver")


#: Servers with extra preloads: modules -> (address, alive fd, pid, mount namespace).
_extra_servers: dict[tuple[str, ...], tuple[Any, int, int, str]] = {}
_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")


def _point(server: Any, state: tuple) -> None:
    """Point ``multiprocessing``'s forkserver singleton at another server's (address, fd, pid)."""
    for attr, value in zip(_SERVER_STATE, state, strict=True):
        setattr(server, attr, value)


@contextlib.contextmanager
def _preloaded_server(modules: list[str]):
    """Start processes of ``rank_context()`` from a warm server that also imported ``modules``.

    ``multiprocessing`` talks to one forkserver (a module singleton): for the
    block, it is pointed at a second one, kept for later calls with the same
    modules and restarted if started in another mount namespace (NOTE [warm
    ranks]). The default server is untouched and restored after.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    key = tuple(modules)
    with server._lock:
        saved = tuple(getattr(server, a) for a in _SERVER_STATE), server._preload_modules
    try:
        old = _extra_servers.pop(key, None)
        with server._lock:
            _point(server, old[:3] if old else (None, None, None))
            server._preload_modules = [*WARM_MODULES, *modules]
        if old is not None and old[3] != _mount_ns():
            server._stop()  # started outside the namespace this process is in now
        server.ensure_running()  # a no-op while that server lives
        with server._lock:
            _extra_servers[key] = (*(getattr(server, a) for a in _SERVER_STATE), _mount_ns())
        yield
    finally:
        with server._lock:
            _point(server, saved[0])
            server._preload_modules = saved[1]


#: Pids of every process this harness started from the warm forkserver.
STARTED: set[int] = set()


def started(p: Any) -> Any:
    """Record a started process of ``rank_context()`` (the leak check counts it)."""
    STARTED.add(p.pid)
    return p


def _rank_main(
    rank: int,
    world: int,
    port: int,
    target: str,
    kwargs: dict,
    outdir: str,
    env: dict[str, str],
    shm_dir: str | None,
    cold: bool = False,
) -> None:
    # The whole environment, not an update: a warm rank was forked from a
    # server started with an earlier test's environment (NOTE [warm ranks]).
    os.environ.clear()
    os.environ.update(env)
    fork_safe_workers()
    try:
        if shm_dir is not None:
            _enter_private_shm(shm_dir)
        module, name = target.split(":")
        # Before the workers' server is forked (NOTE [warm ranks]), in the
        # rank's environment; importing it starts no thread.
        fn = getattr(importlib.import_module(module), name)
        if not cold:
            _fork_worker_server()
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=60)
        # The store is the parent's (run_ranks): ranks may finish in any order.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = fn(rank, world, **kwargs)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if not cold:
            # A forked process ends in os._exit: run what an interpreter's exit
            # runs (atexit handlers, weakref finalizers), as a real rank would.
            import atexit

            atexit._run_exitfuncs()


def _fork_worker_server() -> None:
    """Start this rank's forkserver (its DataLoader workers') by forking the rank.

    A rank's workers come from a forkserver of its own, as in any job: it is
    the rank's child, in the rank's mount namespace and environment, and
    exits when the rank does. ``multiprocessing`` would exec a fresh
    interpreter for it and import torch again; forked from the rank while
    the rank is still single-threaded (before gloo or ZeroMQ start a thread)
    it is the same server with torch already imported (NOTE [warm ranks]).
    """
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server exits at EOF: when this rank is gone
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(alive_w)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def fork_safe_workers(preload: list[str] | None = None) -> None:
    """Make forkserver the default start method of this process.

    DataLoader workers (and any ``multiprocessing`` child without an explicit
    context) start by the default method, which is fork on Linux before
    Python 3.14. A rank forks them after gloo and ZeroMQ started threads, and
    the pytest process after earlier tests did: a fork from a multi-threaded
    process can deadlock the child (Python 3.12 warns). forkserver forks from
    a clean single-threaded server instead; preloading torch there keeps a
    worker's start as fast as a fork's. The pytest process passes
    ``WARM_MODULES``: its forkserver also starts the ranks (NOTE [warm ranks]).
    """
    mp.set_start_method("forkserver", force=True)
    mp.set_forkserver_preload(preload or ["torch", "tests.support.ranks"])


class RankFailure(AssertionError):
    pass


def _gc_main(shm_dir: str | None, owners: set[int] | None, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    if shm_dir is not None:
        _enter_private_shm(shm_dir)
    from shmloader._node import reaping

    reaping.collect_garbage(dry_run=False, owners=owners)


def gc_on_node(shm_dir: str | None, owners: set[int] | None = None) -> None:
    """Run `shmloader gc` as an operator on that (simulated) node would.

    ``owners``: only what these (dead) processes left, so that a test never
    collects other runs' leftovers in the host's ``/dev/shm``.
    """
    p = rank_context().Process(target=_gc_main, args=(shm_dir, owners, dict(os.environ)))
    p.start()
    started(p)
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
    STARTED.discard(p.pid)
    if p.exitcode != 0:
        raise RankFailure(f"gc on node {shm_dir or '/dev/shm'} failed with exit code {p.exitcode}")


@contextlib.contextmanager
def simulated_nodes(count: int, size: str = "2g"):
    """Per-node tmpfs directories for nodes 1..count-1 (node 0 keeps /dev/shm)."""
    dirs: list[str | None] = [None]
    made: list[str] = []
    try:
        for _ in range(1, count):
            d = tempfile.mkdtemp(prefix="shml-node-")
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", d], check=True
            )
            made.append(d)
            dirs.append(d)
        yield dirs
    finally:
        for d in made:
            leftovers = os.listdir(d)
            subprocess.run(["umount", "-l", d], check=False)
            shutil.rmtree(d, ignore_errors=True)
            if leftovers:
                raise RankFailure(f"simulated node shm {d} was left with {leftovers}")


def run_ranks(
    fn: Callable[..., Any] | str,
    world: int,
    *,
    kwargs: dict | None = None,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    nodes: list[int] | None = None,
    timeout: float = 90.0,
    expect_failure: bool = False,
    gc_after: bool = False,
    node_shm_size: str = "2g",
    cold: bool = False,
    preload: list[str] | None = None,
) -> list[Any]:
    """Run ``fn`` on ``world`` real ranks and return their results in rank order.

        With ``expect_failure`` the results of failed ranks are their traceback
        text (a ``str``) instead of raising. ``gc_after`` runs ``shmloader gc`` on
        every node once the ranks are gone (for runs where a rank was SIGKILLed).
    ``node_shm_size`` sizes the simulated nodes' tmpfs (Docker's default is 64m).
    ``cold``: start each rank as a fresh interpreter instead of a warm fork
    (NOTE [warm ranks]). ``preload``: more modules the warm server imports
    once for every rank (NOTE [warm ranks]); ignored by cold ranks.
    """
    target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
    cold = cold_ranks(cold)
    ctx = rank_context(cold)
    import torch.distributed as dist

    # Hosted here rather than by rank 0, so that rank 0 finishing (or dying)
    # first never takes the rendezvous store away from ranks still setting up.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = store.port
    outdir = tempfile.mkdtemp(prefix="shml-ranks-")
    node_of = nodes or [0] * world
    procs = []
    with simulated_nodes(max(node_of) + 1, node_shm_size) as shm_dirs:
        try:
            with contextlib.ExitStack() as starting:
                if preload and not cold:
                    starting.enter_context(_preloaded_server(preload))
                for rank in range(world):
                    rank_vars = {**os.environ, **(env or {})}
                    if nodes is not None:
                        rank_vars["SHMLOADER_NODE"] = f"node{node_of[rank]}"
                    rank_vars.update((rank_env or {}).get(rank, {}))
                    p = ctx.Process(
                        target=_rank_main,
                        args=(
                            rank,
                            world,
                            port,
                            target,
                            kwargs or {},
                            outdir,
                            rank_vars,
                            shm_dirs[node_of[rank]],
                            cold,
                        ),
                        daemon=False,
                    )
                    p.start()
                    procs.append(started(p))
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
                if not p.is_alive():
                    STARTED.discard(p.pid)  # reaped: its pid may be reused
            if gc_after:
                for d in shm_dirs:
                    gc_on_node(d, {p.pid for p in procs if p.pid is not None})
        results: list[Any] = []
        errors = []
        for rank in range(world):
            err = os.path.join(outdir, f"{rank}.err")
            out = os.path.join(outdir, f"{rank}.pt")
            if os.path.exists(err):
                with open(err) as f:
                    text = f.read()
                errors.append(f"--- rank {rank} ---\n{text}")
                results.append(text)
            elif os.path.exists(out):
                results.append(torch.load(out, weights_only=False))
            else:
                errors.append(f"--- rank {rank}: no result (exit code {procs[rank].exitcode}) ---")
                results.append(None)
        shutil.rmtree(outdir, ignore_errors=True)
    if hung:
        raise RankFailure(
            f"ranks {hung} still ran after {timeout} s and were killed\n" + "\n".join(errors)
        )
    if errors and not expect_failure:
        raise RankFailure("\n".join(errors))
    return results


class Warnings(logging.Handler):
    """The messages shmloader logs at WARNING or above in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def capture_warnings() -> Warnings:
    """A ``Warnings`` attached to the ``shmloader`` logger (in a rank: for its life)."""
    handler = Warnings()
    logging.getLogger("shmloader").addHandler(handler)
    return handler
