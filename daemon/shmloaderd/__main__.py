"""The command line of ``shmloaderd`` (also ``shmloader daemon``).

It owns the flags (``shmloaderd --help``: socket, node and per-uid budgets,
metrics address, reap interval, warm pool, node mode, ring directories,
connection bound, log level and format), their parsing and checks (sizes,
budgets, addresses, ring directories), and ``main``, which starts the
``server.Daemon`` and exits 0 after SIGTERM/SIGINT, 2 when it cannot start. It
touches nothing before its arguments are valid.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

# shmloader's package __init__ imports torch lazily, so the daemon loads only
# the light modules it uses (segment, ring, admin, daemon_client, errors).
from shmloader._node import ringdir, segment
from shmloader._node.inventory import ring_dirs
from shmloader.config import well_known_socket
from shmloader.errors import ConfigError, human_bytes

from . import notify
from ._version import __version__
from .guard import DEFAULT_MAX_UID_CONNECTIONS, raise_fd_limit
from .server import Daemon, StartError
from .tenants import UidBudgets, parse_uid, user_name

log = logging.getLogger("shmloaderd")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912; K/M/G/T are powers of 1024; ``KiB``/``KB`` accepted."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use bytes with an optional K/M/G/T suffix, e.g. 8G"
        )
    return int(float(m[1]) * _UNITS[m[2].upper()])


def parse_budget(text: str) -> tuple[str, float]:
    """``"50%"`` -> ("pct", 50.0); ``"8G"`` -> ("bytes", 8589934592)."""
    text = text.strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise argparse.ArgumentTypeError(f"{text!r}: a percentage of /dev/shm in (0, 100]")
        return "pct", pct
    return "bytes", parse_size(text)


def budget_text(spec: tuple[str, float] | None, budget: Callable[[], int | None]) -> str:
    """``spec`` for the log: ``unlimited``, ``8.0 GiB`` or ``25% of /dev/shm (4.0 GiB)``."""
    if spec is None:
        return "unlimited"
    if spec[0] == "pct":
        return f"{spec[1]:g}% of /dev/shm ({human_bytes(budget() or 0)})"
    return human_bytes(int(spec[1]))


def uid_budgets_text(
    per_uid: list[tuple[int, tuple[str, float]]], default: tuple[str, float] | None
) -> str:
    """The per-user budgets for the startup line: ``1001 (alice) 8.0 GiB, default 25% ...``."""
    parts = [
        f"{uid} ({user_name(uid)}) {budget_text(spec, budget_function(spec))}"
        for uid, spec in per_uid
    ]
    if default is not None:
        parts.append(f"default {budget_text(default, budget_function(default))}")
    return ", ".join(parts)


def budget_function(spec: tuple[str, float] | None) -> Callable[[], int | None]:
    """A callable giving the budget in bytes now (a percentage follows /dev/shm's size)."""
    if spec is None:
        return lambda: None
    kind, value = spec
    if kind == "bytes":
        return lambda: int(value)

    def pct() -> int | None:
        try:
            st = os.statvfs(segment.SHM_DIR)  # the first --shm-dir, else /dev/shm
        except OSError:
            return None
        return int(st.f_blocks * st.f_frsize * value / 100)

    return pct


def check_shm_dirs(dirs: list[str]) -> list[str]:
    """Check each ``--shm-dir``, log what backs it, and make the first one ours.

    Returns every ring directory the daemon reaps and accounts (``/dev/shm``
    first). A directory that does not exist or is not safe is a ``ConfigError``
    (``ringdir.check``); one that does not give 2 MiB pages is logged as such.
    """
    for d in dirs:
        ringdir.check(d, "--shm-dir")
    if dirs:
        segment.use_dir(dirs[0])
    out = ring_dirs(dirs)
    for d in out:
        f = ringdir.describe(d)
        log.info(
            "ring directory %s: %s on %s, huge=%s, mode %s, owner uid %d: %s",
            d,
            f.fs or "unknown filesystem",
            f.mount or "?",
            f.huge_option,
            f.mode,
            f.owner,
            f.why,
        )
    return out


def parse_uid_budget(text: str) -> tuple[int, tuple[str, float]]:
    """``"1001=8G"`` or ``"alice=25%"`` -> (uid, budget spec)."""
    uid_text, sep, budget = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: use UID=SIZE or UID=PCT%, e.g. 1001=8G")
    try:
        uid = parse_uid(uid_text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return uid, parse_budget(budget)


def node_mode(args: argparse.Namespace, euid: int) -> bool:
    """Whether to serve every user: ``--tenants``, or root without ``--single-user``."""
    if args.tenants is not None:
        return args.tenants
    return euid == 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} must be a TCP port 1-65535")
    return int(text)


def parse_addr(text: str) -> tuple[str, int]:
    """``"0.0.0.0:9464"`` -> ("0.0.0.0", 9464); ``"[::]:9464"`` -> ("::", 9464)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or (":" in host and not text.startswith("[")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use HOST:PORT, e.g. 0.0.0.0:9464, 127.0.0.1:9464 or [::]:9464"
        )
    return host, _port(port)


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object per line (time, level, logger, pid, message)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
            + f".{int(record.msecs):03d}"
            + time.strftime("%z", time.localtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmloaderd",
        description="Per-node shmloader daemon: shared-memory budget, reaping of crashed "
        "jobs' segments, stats (shmloader stat) and optional warm segments.",
    )
    p.add_argument(
        "--socket",
        default=well_known_socket(),
        metavar="PATH",
        help="control socket; its directory must be ours, 0700 (0755 in node mode); the "
        "default is where jobs look for it without SHMLOADER_DAEMON: /run/shmloader/"
        "control.sock, or $SHMLOADER_RUNTIME_DIR/shmloader/control.sock where that is set "
        f"(here {well_known_socket()})",
    )
    p.add_argument(
        "--budget",
        type=parse_budget,
        default=None,
        metavar="SIZE|PCT%",
        help="node budget for shmloader jobs: bytes with K/M/G/T suffix, or a percentage "
        "of /dev/shm such as 50%% (default: no budget, only /dev/shm's own size)",
    )
    metrics = p.add_mutually_exclusive_group()
    metrics.add_argument(
        "--metrics-addr",
        type=parse_addr,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on HOST:PORT, e.g. 0.0.0.0:9464 for a scraper on "
        "another machine (default: off; systemd/alerts.yml has alert rules)",
    )
    metrics.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="the same as --metrics-addr 127.0.0.1:PORT",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        type=str.lower,
        help="text lines (default) or one JSON object per line (time, level, logger, pid, "
        "message) for a log collector",
    )
    p.add_argument(
        "--reap-interval",
        type=_positive,
        default=0.5,
        metavar="SECONDS",
        help="seconds between reaper passes (default 0.5)",
    )
    p.add_argument(
        "--pool",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="keep this many bytes of pre-touched segments for rings to adopt (default 0)",
    )
    p.add_argument(
        "--pool-segment",
        type=parse_size,
        default=64 << 20,
        metavar="SIZE",
        help="payload bytes of each warm segment (default 64M)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--tenants",
        dest="tenants",
        action="store_const",
        const=True,
        default=None,
        help="node mode: serve every user of the node (the default when started as root); "
        "the socket directory is 0755 and the socket 0666, each client is known by its "
        "SO_PEERCRED",
    )
    mode.add_argument(
        "--single-user",
        dest="tenants",
        action="store_const",
        const=False,
        help="serve only our own uid, even as root (socket 0600 in a 0700 directory)",
    )
    p.add_argument(
        "--uid-budget",
        type=parse_uid_budget,
        action="append",
        default=[],
        metavar="UID=SIZE|PCT%",
        help="node mode: all jobs of this uid (or user name) together stay under SIZE "
        "(repeatable); the node --budget still caps the sum",
    )
    p.add_argument(
        "--default-uid-budget",
        type=parse_budget,
        default=None,
        metavar="SIZE|PCT%",
        help="node mode: the budget of every uid without its own --uid-budget "
        "(default: none, only the node budget)",
    )
    p.add_argument(
        "--shm-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a ring directory to reap and account besides /dev/shm (repeatable): what jobs "
        "set as SHMLOADER_SHM_DIR, e.g. a tmpfs mounted with huge=within_size. The first one "
        "also holds the warm segments and is what admissions and a percentage --budget measure",
    )
    p.add_argument(
        "--max-uid-connections",
        type=_count,
        default=DEFAULT_MAX_UID_CONNECTIONS,
        metavar="N",
        help="connections to the control socket one uid may hold at once; more are closed "
        f"(root is not bounded; default {DEFAULT_MAX_UID_CONNECTIONS})",
    )
    p.add_argument("--version", action="version", version=f"shmloaderd {__version__}")
    return p


# Started as root (or with ``--tenants``) the daemon serves every user of the node
# (NOTE [tenants] in ``tenants``); as any other user, or with ``--single-user``,
# only its own uid. Exit codes: 0 after SIGTERM/SIGINT, 2 for a bad argument or
# when it cannot start (the message says why: socket directory not ours, another
# daemon already serving the socket, ...).
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s shmloaderd[%(process)d] %(levelname)s %(message)s")
        )
    logging.basicConfig(level=args.log_level, handlers=[handler])
    soft, hard = raise_fd_limit()  # NOTE [connection bound] in ``guard``
    log.info("open files: up to %d (hard limit %d)", soft, hard)
    if soft < 4 * args.max_uid_connections:
        log.warning(
            "the open-file limit %d leaves little room beside --max-uid-connections %d: raise "
            "LimitNOFILE= (ulimit -n) or lower --max-uid-connections",
            soft,
            args.max_uid_connections,
        )
    if args.pool and args.pool_segment <= 0:
        print("shmloaderd: --pool-segment must be > 0", file=sys.stderr)
        return 2
    try:
        shm_dirs = check_shm_dirs(args.shm_dir)
    except ConfigError as exc:
        print(f"shmloaderd: {exc}", file=sys.stderr)
        return 2
    budget = budget_function(args.budget)
    tenants = node_mode(args, os.geteuid())
    if (args.uid_budget or args.default_uid_budget) and not tenants:
        print(
            "shmloaderd: --uid-budget and --default-uid-budget need node mode (run as root "
            "or with --tenants)",
            file=sys.stderr,
        )
        return 2
    uid_budgets = UidBudgets(
        {uid: budget_function(spec) for uid, spec in args.uid_budget},
        None if args.default_uid_budget is None else budget_function(args.default_uid_budget),
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon = Daemon(
        args.socket,
        budget=budget,
        budget_text=budget_text(args.budget, budget),
        uid_budget_text=uid_budgets_text(args.uid_budget, args.default_uid_budget),
        reap_interval=args.reap_interval,
        pool_bytes=args.pool,
        pool_segment=args.pool_segment,
        tenants=tenants,
        uid_budgets=uid_budgets,
        shm_dirs=shm_dirs,
        max_uid_connections=args.max_uid_connections,
    )
    metrics = None
    try:
        try:
            daemon.bind()
            addr = args.metrics_addr
            if addr is None and args.metrics_port is not None:
                addr = ("127.0.0.1", args.metrics_port)
            if addr is not None:
                from .metrics import MetricsServer

                metrics = MetricsServer(addr[1], daemon.snapshot, addr=addr[0])
                host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
                log.info("metrics on http://%s:%d/metrics", host, metrics.port)
        except (StartError, OSError) as exc:
            print(f"shmloaderd: cannot start: {exc}", file=sys.stderr)
            return 2
        notify.notify(f"READY=1\nSTATUS=serving {daemon.path}\nMAINPID={os.getpid()}")
        daemon.serve(stop)
        notify.notify("STOPPING=1")
    finally:
        if metrics is not None:
            metrics.close()
        daemon.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
