"""Set-up arrival: each rank's mark in the process group's store, read before any collective.

It owns the marks (``Mark``: pid, node, sharing on or off, the settings every
rank must agree on, ``AGREED``, and those only noted, ``NOTED``), the wait for
every rank's mark with heartbeats and liveness checks, and the errors that name
a peer with other settings, a dead one or a missing one (NOTE [set-up marks]).
It touches only its keys in the default store of ``torch.distributed`` and
imports only ``segment`` (process liveness) and ``errors``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._node import segment
from ..errors import ConfigMismatchError, PeerLostError

log = logging.getLogger("shmloader.loader")

#: Seconds between two reads of the store while waiting for peers' marks, for
#: the first ``POLL_FAST_S`` seconds; ``POLL_SLOW_S`` after that, so that a
#: large job's ranks waiting for a slow peer do not load the store. The first
#: reads come sooner (``POLL_FIRST_S``, doubling up to ``POLL_S``): ranks that
#: construct together find each other's marks within milliseconds.
POLL_FIRST_S = 0.002
POLL_S = 0.1
POLL_FAST_S = 5.0
POLL_SLOW_S = 0.5
#: Seconds between two warnings naming the ranks still missing.
WAIT_LOG_EVERY_S = 30.0
#: A peer on another host (or pid namespace) whose heartbeat stands still this
#: long is lost (peers on this host are judged by pid and start time at once).
HEARTBEAT_STALE_S = 3.0

#: Settings every rank of a group must agree on, with how a user sets each.
#: ``copy``, ``slots``, ``small_copy_bytes``: what each rank's batches are
#: made of and how far the writer runs ahead; ``allow_pickle``/``verify``:
#: how readers decode what the writer encoded; ``accumulation_steps``,
#: ``prefetch``: where checkpoints and prefetch windows fall. ``shm_dir``: where
#: readers find the writer's segments (NOTE [huge-page ring] in ``ringdir``).
AGREED: dict[str, str] = {
    "accumulation_steps": "ShmLoader(accumulation_steps=...)",
    "prefetch": "SHMLOADER_PREFETCH",
    "slots": "SHMLOADER_SLOTS",
    "copy": "SHMLOADER_COPY",
    "verify": "SHMLOADER_VERIFY",
    "allow_pickle": "Config.from_env(allow_pickle=...)",
    "small_copy_bytes": "SHMLOADER_SMALL_COPY",
    "shm_dir": "SHMLOADER_SHM_DIR",
}

#: Settings ranks may set differently on purpose, named in one warning when they
#: do: ``device``, the delivery kind asked for (``cpu``, ``cuda``, ``auto``). A
#: group may mix host and GPU delivery (``auto`` on ranks with and without a
#: GPU, a host rank beside GPU ranks); batches are the same bytes either way.
NOTED: dict[str, str] = {
    "device": "ShmLoader(device=...) or SHMLOADER_DEVICE",
}

#: ShmLoaders constructed so far per group (rank tuple) in this process: ``n``.
_CONSTRUCTIONS: dict[tuple[int, ...], int] = {}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Mark:
    """What one rank leaves in the store when it constructs its ShmLoader."""

    rank: int
    pid: int
    start: int
    boot: str
    pidns: int
    host: str
    node: str
    sharing: bool
    agreed: dict[str, Any]
    since: float  # wall-clock time of the mark

    @classmethod
    def mine(cls, rank: int, *, node: str, sharing: bool, agreed: dict[str, Any]) -> Mark:
        return cls(
            rank,
            os.getpid(),
            segment.MY_START,
            _boot_id(),
            segment.MY_PIDNS,
            socket.gethostname(),
            node,
            sharing,
            agreed,
            time.time(),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Mark | None:
        try:
            d = json.loads(raw)
            return cls(
                int(d["rank"]),
                int(d["pid"]),
                int(d["start"]),
                str(d["boot"]),
                int(d["pidns"]),
                str(d["host"]),
                str(d["node"]),
                bool(d["sharing"]),
                dict(d["agreed"]),
                float(d["since"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def same_host(self) -> bool:
        """Whether this mark's pid can be judged here (same boot and pid namespace)."""
        return bool(self.boot) and self.boot == _boot_id() and self.pidns == segment.MY_PIDNS


# NOTE [set-up marks]
#     Every rank that constructs a ``ShmLoader`` over a group of more than one
#     rank leaves a *mark* in the default store of ``torch.distributed`` (the
#     key-value store every rank already reaches; no collective), whether
#     sharing is on or off::
#
#         shmloader/setup/<ranks, '-'-joined>/<n>/<rank>   -> JSON mark
#         shmloader/setup/<ranks, '-'-joined>/<n>/on       -> a rank with sharing on
#         shmloader/setup/<ranks, '-'-joined>/<n>/hb/<rank> -> heartbeat counter
#
#     ``n`` counts this process's ShmLoaders over the same ranks (train and eval
#     loaders, a second construction after a failed one): every rank of a
#     group constructs its loaders over that group in the same order, so equal
#     ``n`` means the same construction. A mark holds the rank's pid, start
#     time, boot id, pid namespace, host, node claim, whether sharing is on and
#     the settings every rank must agree on (``AGREED``).
#
#     - Sharing off costs one ``set`` and one ``check`` of the ``on`` key, no
#       wait: a rank with sharing off whose peers have it on says so once in a
#       warning, and loads its own batches as without shmloader.
#     - Sharing on: the rank waits until every rank of the group has marked,
#       reading each mark once as it appears (every ``POLL_S``, after
#       ``POLL_FAST_S`` every ``POLL_SLOW_S``). A peer with
#       sharing off, or with other ``AGREED`` settings, is a ``ConfigError``
#       naming the rank, the setting and the values (every rank with sharing on
#       sees every mark, so each of them raises); other ``NOTED`` settings
#       (the device kind: a group may mix host and GPU delivery) are named in
#       a warning. A peer that marked and died
#       is a ``PeerLostError`` within about a second: by pid and start time on
#       the same host and pid namespace, else by its heartbeat counter standing
#       still for ``HEARTBEAT_STALE_S``. Ranks still missing are named in a
#       warning every ``WAIT_LOG_EVERY_S`` and, at the timeout, in a
#       ``PeerLostError``.
#
#     A rank leaves the wait only once every mark is present; so while some
#     rank is missing no peer has left (and stopped its heartbeat) for a
#     reason other than death.
class Arrival:
    """One construction's marks over ``ranks`` (NOTE [set-up marks])."""

    def __init__(
        self, store: Any, me: int, ranks: list[int], mark: Mark, n: int | None = None
    ) -> None:
        self.store = store
        self.me = me
        self.ranks = sorted(ranks)
        self.mark = mark
        if n is None:  # this process's next construction over these ranks
            key = tuple(self.ranks)
            n = _CONSTRUCTIONS[key] = _CONSTRUCTIONS.get(key, 0) + 1
        self.prefix = f"shmloader/setup/{'-'.join(map(str, self.ranks))}/{n}/"
        self.marks: dict[int, Mark] = {}
        self.warned = False  # sharing off: a peer with sharing on was reported

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    # ------------------------------------------------------------ sharing off

    def leave_mark(self) -> bool:
        """Sharing off: one set, one check; warn (and return True) if a peer has sharing on."""
        self.store.set(self.key(self.me), self.mark.to_bytes())
        return self.check_peers_on()

    def check_peers_on(self) -> bool:
        """Warn (and return True) when a peer of this construction has sharing on."""
        on = self.prefix + "on"
        try:
            if not self.store.check([on]):
                return False
            peer = self.store.get(on).decode(errors="replace")
        except (RuntimeError, OSError) as exc:  # sharing off never fails for shmloader's sake
            log.debug("shmloader: set-up marks not readable: %s", exc)
            return False
        self.warned = True
        log.warning(
            "shmloader: rank %d has sharing off (SHMLOADER unset or 0, or a Config with "
            "enabled=False) while rank %s of its group %s has it on: this rank loads its "
            "own batches, and the ranks with sharing on fail with a ConfigError naming "
            "this rank. Set SHMLOADER=1 (or 0) for every rank of the job",
            self.me,
            peer,
            self.ranks,
        )
        return True

    # ------------------------------------------------------------- sharing on

    def wait(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> dict[int, Mark]:
        """Mark, then wait for every peer's mark; raise what NOTE [set-up marks] says."""
        store = self.store
        store.set(self.key(self.me), self.mark.to_bytes())
        store.set(self.prefix + "on", str(self.me).encode())
        self.marks[self.me] = self.mark
        t0 = clock()
        since = time.strftime("%H:%M:%S UTC", time.gmtime(self.mark.since))
        next_log = t0 + WAIT_LOG_EVERY_S
        beats: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        pause = POLL_FIRST_S
        while True:
            store.add(f"{self.prefix}hb/{self.me}", 1)
            for rank in self.ranks:
                if rank not in self.marks and store.check([self.key(rank)]):
                    self._read(rank)
            missing = [r for r in self.ranks if r not in self.marks]
            if not missing:
                return self.marks
            now = clock()
            for rank, mark in self.marks.items():
                if rank != self.me:
                    self._check_alive(mark, beats, now)
            if now - t0 >= timeout:
                raise PeerLostError(
                    None,
                    _ranks_text(missing),
                    f"{'they have' if len(missing) > 1 else 'it has'} not constructed "
                    f"{'their' if len(missing) > 1 else 'its'} ShmLoader over ranks "
                    f"{self.ranks} within {timeout:.0f} s (no set-up mark in the process "
                    "group's store; SHMLOADER_TIMEOUT, default the process group's "
                    "timeout): every rank of the group must construct it at the same point",
                )
            if now >= next_log:
                next_log = now + WAIT_LOG_EVERY_S
                log.warning(
                    "shmloader: rank %d has waited since %s (%.0f s) for %s to construct "
                    "their ShmLoader over ranks %s; giving up after %.0f s (SHMLOADER_TIMEOUT)",
                    self.me,
                    since,
                    now - t0,
                    _ranks_text(missing),
                    self.ranks,
                    timeout,
                )
            time.sleep(pause if now - t0 < POLL_FAST_S else POLL_SLOW_S)
            pause = min(2 * pause, POLL_S)

    def _read(self, rank: int) -> None:
        mark = Mark.parse(self.store.get(self.key(rank)))
        if mark is None or mark.rank != rank:
            raise ConfigMismatchError(
                "set-up mark",
                {rank: "unreadable"},
                f"rank {rank} left a set-up mark this version of shmloader cannot read: "
                "run the same shmloader version on every rank",
            )
        if not mark.sharing:
            raise ConfigMismatchError(
                "SHMLOADER",
                {self.me: "1", rank: "0"},
                f"rank {rank} constructed its ShmLoader over ranks {self.ranks} with sharing "
                f"off (SHMLOADER unset or 0 there, or a Config with enabled=False) while rank "
                f"{self.me} has it on: set SHMLOADER=1 (or 0) for every rank of the job",
            )
        for name, how in AGREED.items():
            mine, theirs = self.mark.agreed.get(name), mark.agreed.get(name)
            if mine != theirs:
                raise ConfigMismatchError(
                    name,
                    {self.me: mine, rank: theirs},
                    f"every rank of the group {self.ranks} must construct its ShmLoader with "
                    f"the same {name} (set by {how})",
                )
        for name, how in NOTED.items():
            mine, theirs = self.mark.agreed.get(name), mark.agreed.get(name)
            if mine != theirs:
                log.warning(
                    "shmloader: rank %d asks for %s=%r and rank %d for %r (%s); the group "
                    "mixes host and GPU delivery. If that is not meant, set it the same on "
                    "every rank",
                    self.me,
                    name,
                    mine,
                    rank,
                    theirs,
                    how,
                )
        self.marks[rank] = mark

    def _check_alive(self, mark: Mark, beats: dict[int, tuple[int, float]], now: float) -> None:
        if mark.same_host():
            if segment.process_alive(mark.pid, mark.start):
                return
            detail = f"process {mark.pid} on {mark.host} marked its set-up and exited"
        else:
            raw = self.store.get(f"{self.prefix}hb/{mark.rank}") if self._has_beat(mark) else b"0"
            count = int(raw or b"0")
            last = beats.get(mark.rank)
            if last is None or last[0] != count:
                beats[mark.rank] = (count, now)
                return
            if now - last[1] < HEARTBEAT_STALE_S:
                return
            detail = (
                f"process {mark.pid} on {mark.host} marked its set-up and its heartbeat "
                f"stood still for {now - last[1]:.1f} s"
            )
        raise PeerLostError(mark.rank, "set-up peer", f"{detail} while this rank waited")

    def _has_beat(self, mark: Mark) -> bool:
        return bool(self.store.check([f"{self.prefix}hb/{mark.rank}"]))


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def default_store() -> Any | None:
    """The default process group's store, or None (a world of one, internals changed)."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def arrive(
    ranks: list[int] | None,
    me: int,
    *,
    sharing: bool,
    node: str,
    agreed: dict[str, Any],
    timeout: float,
    store: Any | None = None,
) -> Arrival | None:
    """Leave this rank's mark; with sharing on, wait for every peer's (NOTE [set-up marks]).

    Returns the arrival (its ``marks``: every rank's, with sharing on), or
    None without a group of more than one rank or a store to mark in.
    """
    if ranks is None or len(ranks) < 2:
        return None
    store = default_store() if store is None else store
    if store is None:
        return None
    arrival = Arrival(store, me, ranks, Mark.mine(me, node=node, sharing=sharing, agreed=agreed))
    if not sharing:
        try:
            arrival.leave_mark()
        except (RuntimeError, OSError) as exc:  # sharing off never fails for shmloader's sake
            log.debug("shmloader: set-up mark not left: %s", exc)
        return arrival
    try:
        arrival.wait(timeout)
        return arrival
    except (RuntimeError, OSError) as exc:  # the store itself failed (its host died)
        raise PeerLostError(
            None, "peer", f"the set-up marks could not be read from the store: {exc}"
        ) from exc


def agreed_settings(config: Any, accumulation_steps: int, device_kind: str) -> dict[str, Any]:
    """The ``AGREED`` settings of one rank, as they go into its mark."""
    return {
        "accumulation_steps": accumulation_steps,
        "device": device_kind,
        "prefetch": config.prefetch,
        "slots": config.slots,
        "ahead": config.ahead,
        "copy": config.copy,
        "verify": config.verify,
        "allow_pickle": config.allow_pickle,
        "small_copy_bytes": config.small_copy_bytes,
        "shm_dir": os.path.realpath(config.shm_dir),
    }
