"""The cross-node path (``CrossNode``): the group leader sends each event (a ``CrossHeader``,
the metadata, the payload) point-to-point to every node leader over the group's gloo
exchange group, and a node leader receives it, the payload straight into the slot of
its own ring it is given. Every gloo call of a loader is made by one thread, its link
(``Link``, NOTE [the link owns gloo]); the producer hands it jobs and waits for each in
slices, checking between them. It sends and receives ``wire.CrossHeader`` (the event's
``Kind`` and stamps, checked on arrival), and touches nothing else: the ring and the
stamps are the node writer's (``_roles.node_writer``). The messages, and why the path is
built this way: ``docs/internals/datapath.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import queue
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .._proto.bodies import json_body
from .._proto.wire import CrossHeader, Kind
from ..errors import PeerLostError, ProtocolError, ShmLoaderError
from .channel import SLICE_S

#: Longest the leader's ``close()`` waits for node leaders to take its closing STOP
#: (NOTE [closing across nodes]); after it the message stays posted, and is taken when
#: they close.
CLOSE_WAIT_S = 2.0
#: The timeout of every gloo wait of a link (NOTE [a link of its own]): longer than any
#: pause of a training job.
LINK_TIMEOUT = datetime.timedelta(days=7)

T = TypeVar("T")


class Event(NamedTuple):
    """What a node leader received of one event: its header and metadata (the payload follows)."""

    head: CrossHeader
    meta: bytes

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    @property
    def crc(self) -> int:
        return self.head.crc


def loader_tag(token: str) -> int:
    """The point-to-point tag of one loader's cross-node messages, from its leader's random
    token (every rank of the group knows it): loaders on one group never share a tag."""
    return zlib.crc32(token.encode()) & 0x7FFFFFFF


# NOTE [the link owns gloo]
#     A gloo call cannot be cancelled or polled: a send waits until its peer
#     posts the matching receive, a receive until the message comes (or its
#     own timeout: NOTE [a link of its own]). So no thread that must answer
#     to ``close()`` makes one. Each ``CrossNode`` has a link thread
#     that makes every gloo call of the loader, in the order its jobs came:
#
#         producer                        link thread ("shmloader-link")
#         --------                        -------------------------------
#         send(BATCH k) ---- job ------>  isend header, meta, payload; wait
#         wait, a check per SLICE_S       ...
#                        <--- done -----  (bytes_sent, or the link broke)
#         receive_header() -- job ---->   recv header, meta (``owed`` payload)
#         receive_payload(slot) - job ->  recv into the slot
#
#     The producer waits for a job in slices and checks its owner between
#     them (NOTE [one owner] in ``_roles.base``): a halted iteration or a
#     ``close()`` takes it out of the wait at once, and the job goes on on
#     the link. What the job touches it keeps alive: a send's tensors are
#     views of the ring slot, whose mapping outlives the ring's close
#     (``ring`` closes a mapping with exported views only once they die).
#     A header the producer no longer waited for is taken by its next
#     ``receive_header`` (``_pending``), never asked for twice. The link's
#     state (``owed``, the closing STOP said or received) is read and written
#     only by jobs, so it needs no lock. After the loader's last job
#     (``finish``) the link ends; a job stuck in gloo keeps only that daemon
#     thread.


# NOTE [a link of its own]
#     A gloo wait does end: at its group's timeout by default, and then
#     gloo closes every pair of the group (every later message and
#     collective on it fails: the user's own, where the group is the
#     user's gloo group). A link's waits are as long as its users' pauses:
#     a node leader ahead receives the next header while an in-step
#     leader's user evaluates, a leader ahead sends while a node leader's
#     user does, and a send left in flight at a break waits for the node
#     leader's next iteration. So every wait of a link is given a timeout
#     of its own, ``LINK_TIMEOUT`` (7 days; the group's default is not
#     changed: torch's setting of a group's timeout after it was made does
#     not reach a point-to-point wait of gloo, tried). A peer that dies ends
#     a wait at once (its sockets close); one alive but silent is bounded by
#     the loader's own timeout, on the producer's side of the wait
#     (``CrossNode._wait``): lost once the user too has waited that long
#     (``Producer.patient``), as a peer on the node is; the gloo job goes on
#     on the link. Pinned over two nodes by
#     ``test_a_pause_longer_than_the_timeout_fails_nothing``, whose group has
#     a 5 s timeout and whose ranks pause 6 s.


class Link:
    """One thread that runs the jobs it is handed, in order (NOTE [the link owns gloo])."""

    def __init__(self, name: str = "shmloader-link") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()  # one start, whoever hands the first job
        self._finished = False
        # a link nobody finished ends with its owner
        weakref.finalize(self, self._jobs.put, None)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on the link after every job handed before it; its future."""
        done: Future[T] = Future()
        with self._start:
            if self._finished:  # no job after the last: it would never run
                raise ShmLoaderError("this loader's cross-node link is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_run_jobs, args=(self._jobs,), name=self.name, daemon=True
                )
                self._thread.start()
            self._jobs.put((job, done))  # under the lock: never after finish()'s end
        return done

    def finish(self) -> None:
        """The link ends after the jobs handed so far; it takes no more."""
        with self._start:
            if self._finished:
                return
            self._finished = True
        self._jobs.put(None)


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while (item := jobs.get()) is not None:
        job, done = item
        try:
            done.set_result(job())
        except BaseException as exc:  # the waiter's (or nobody's) to raise
            done.set_exception(exc)
        del item, job, done  # nothing of a finished job stays alive on the link


# NOTE [closing across nodes]
#     A posted message that nobody receives blocks nothing else: other tags
#     and the group's collectives pass it (tried on torch's gloo). So the
#     leader's loop, running ahead, may have sent node leaders batches past
#     where their users left, and those sends wait on the leader's link.
#     The rules that keep every message received and no close() waiting:
#
#         leader                                node leader
#         ------                                -----------
#         send k    (its link waits)            loop: receive k, k+1, ...
#         send k+1  ... queued on the link      user leaves: loop halted
#         close(): STOP {closed}, the link's    close(): ``drain`` on the link:
#                  last job (after k+1;         every event up to the leader's
#                  sends after it refused);     closing STOP, each payload into
#                  waited CLOSE_WAIT_S          nothing
#
#     - the leader's closing STOP is the last message of the loader: the
#       link's jobs run in order (gloo keeps one pair's messages of a tag in
#       order), and a send handed after it is refused;
#     - a node leader's ``close()`` hands its link a drain up to that STOP,
#       unless a job already received it: the leader's sends all complete,
#       and both links end. An iteration left early is drained by the next
#       one (``NodeLeader._next_event``);
#     - each loader's messages carry their own tag (``loader_tag``), so a
#       receive a closed loader's drain still has posted never takes a later
#       loader's message on the same group; a link that broke ends the drain
#       (the leader died: there is nothing left to receive).


class CrossNode:
    """The leader's sends to node leaders, and a node leader's receives: each a job on the
    loader's link, waited for by the caller in slices of ``SLICE_S`` with ``check`` between."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        leader: int,
        node_leaders: tuple[int, ...],
        tag: int = 0,
        check: Callable[[], None] = lambda: None,
        *,
        timeout: float | None = None,
        patient: Callable[[], bool] = lambda: False,
    ) -> None:
        self.group = group
        self.leader = leader
        #: this loader's messages on the group (``loader_tag``): a node leader's receive
        #: still posted by a closed loader never takes a later loader's on the same group
        self.tag = tag
        self.peers = tuple(r for r in node_leaders if r != leader)
        #: raises to end a wait (the loader's owner: closed, or the iteration halted)
        self.check = check
        #: how long a wait may last while the user waits too (``SHMLOADER_TIMEOUT``; None:
        #: no bound), and whether the user is not waiting that long yet (``Producer.patient``)
        self.timeout, self.patient = timeout, patient
        self.link = Link()
        self._pending: Future[Event] | None = None  # a header nobody waited for to the end
        self._in_flight: Future[None] | None = None  # a send nobody waited for to the end
        # -- written by jobs only (NOTE [the link owns gloo]) --
        self.bytes_sent = 0
        #: set when a transfer failed: the link, not the data, is what broke
        self.broken = False
        self._said_closed = False  # the leader's closing STOP is posted: no send after it
        self._got_closing = False  # a node leader received it: nothing is left to drain
        self._owed = 0  # payload bytes of the last header received, not received yet
        self._last: CrossHeader | None = None  # that header

    def _wait(self, done: Future[T], who: str, doing: str) -> T:
        """The job's result, waited for in slices with ``check`` between. A peer silent for
        ``timeout`` while the user waits that long too is lost (the job goes on on the link:
        NOTE [a link of its own])."""
        timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check()
            try:
                return done.result(timeout=SLICE_S)
            except TimeoutError:
                pass
            if deadline is None or time.monotonic() < deadline:
                continue
            if self.patient():  # its user is not waiting that long: neither does the loop
                deadline = time.monotonic() + timeout  # type: ignore[operator]
                continue
            raise PeerLostError(
                None, who, f"no answer for {timeout:.0f} s (SHMLOADER_TIMEOUT) while {doing}"
            )

    def _to_peers(self) -> str:
        return f"node leader(s) {list(self.peers)}"

    def _from_leader(self) -> str:
        return f"leader rank {self.leader}"

    def _failed(self, exc: Exception, who: str) -> PeerLostError:
        self.broken = True
        return PeerLostError(None, who, f"the cross-node transfer failed: {exc}")

    def close(self) -> None:
        """The loader closed: the link ends after the jobs handed so far."""
        self.link.finish()

    # -- leader ------------------------------------------------------------

    def send(
        self,
        kind: Kind,
        it: int,
        meta: bytes,
        payload: np.ndarray | None = None,
        *,
        at: tuple[int, int],
        draws: int = 0,
        crc: int = -1,
    ) -> None:
        """Send one event, stamped with (epoch, pos) ``at``, to every node leader, and wait
        until each took it."""
        nbytes = 0 if payload is None else payload.nbytes
        head = CrossHeader(kind, it, nbytes, len(meta), draws, crc, *at)
        self._in_flight = self.link.submit(lambda: self._send(head, meta, payload))
        self._wait(self._in_flight, self._to_peers(), f"sending {kind.name} to them")
        self._in_flight = None

    # NOTE [a slot in flight]
    #     A send the producer stopped waiting for (its iteration was halted)
    #     still reads its payload, a view of a ring slot that the next
    #     publish may acquire again (an unannounced slot is FREE), or a pool
    #     slot that the pool would give back to the DataLoader workers (an
    #     unannounced pool slot looks released). So while a send is in
    #     flight the leader fills no slot (``sent``) and gives no pool slot
    #     back (``sending``): a node leader still in that iteration would
    #     otherwise receive a batch whose bytes changed under the send. It
    #     costs nothing: the link sends one event at a time, and only a
    #     halted send is ever left in flight.
    def sent(self) -> None:
        """Wait until the last send completed (NOTE [a slot in flight])."""
        if self._in_flight is not None:
            self._wait(self._in_flight, self._to_peers(), "sending them a batch")
            self._in_flight = None

    def sending(self) -> bool:
        """Whether a send nobody waited for to the end still runs (NOTE [a slot in flight])."""
        return self._in_flight is not None and not self._in_flight.done()

    def _send(self, head: CrossHeader, meta: bytes, payload: np.ndarray | None) -> None:
        if self._said_closed:
            raise ShmLoaderError("this loader's cross-node link is closed")
        try:
            for work in self._post(head, meta, payload):
                work.wait(LINK_TIMEOUT)  # NOTE [a link of its own]
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None
        self.bytes_sent += head.nbytes * len(self.peers)

    def _post(self, head: CrossHeader, meta: bytes, payload: np.ndarray | None) -> list:
        """Post the event's messages to every node leader; their works."""
        tensors = [torch.frombuffer(bytearray(head.pack()), dtype=torch.int64)]
        if meta:
            tensors.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if head.nbytes:
            tensors.append(torch.from_numpy(payload))
        try:
            return [
                dist.isend(t, dst=peer, group=self.group, tag=self.tag)
                for t in tensors
                for peer in self.peers
            ]
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"node leader(s) {list(self.peers)}") from None

    def send_json(self, kind: Kind, it: int, body: dict, *, at: tuple[int, int]) -> None:
        self.send(kind, it, json.dumps(body).encode(), at=at)

    def say_closed(self, it: int, *, at: tuple[int, int]) -> None:
        """The leader's last message: STOP {closed}, after everything handed before it
        (NOTE [closing across nodes]). Waits at most ``CLOSE_WAIT_S`` for node leaders
        to take it; never raises."""
        meta = json.dumps({"reason": "the leader closed", "closed": 1}).encode()
        head = CrossHeader(Kind.STOP, it, 0, len(meta), 0, -1, *at)
        # not taken in time (it stays posted), the link broke or ended: nothing to say
        with contextlib.suppress(Exception):
            done = self.link.submit(lambda: self._post_closing(head, meta))
            self.link.finish()
            done.result(timeout=CLOSE_WAIT_S)
        self.link.finish()

    def _post_closing(self, head: CrossHeader, meta: bytes) -> None:
        if self._said_closed or self.broken:
            return
        self._said_closed = True
        for work in self._post(head, meta, None):
            work.wait(LINK_TIMEOUT)

    # -- node leader ---------------------------------------------------------

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            work = dist.irecv(tensor, src=self.leader, group=self.group, tag=self.tag)
            assert work is not None  # None only on a rank outside the group
            work.wait(LINK_TIMEOUT)  # NOTE [a link of its own]
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failed(exc, f"leader rank {self.leader}") from None

    def receive_header(self) -> Event:
        """The next event's header and metadata; its payload is ``receive_payload``'s (or
        ``skip_payload``'s: one left owed is skipped first). A header asked for before and
        not waited for to the end is this one."""
        if self._pending is None:
            self._pending = self.link.submit(self._receive_header)
        event = self._wait(self._pending, self._from_leader(), "waiting for its next batch")
        self._pending = None
        return event

    def _receive_header(self) -> Event:
        self._skip()
        raw = torch.zeros(len(CrossHeader._fields), dtype=torch.int64)
        self._recv(raw)
        head = CrossHeader.unpack(raw.numpy().tobytes())
        meta = b""
        if head.meta_len:
            buf = torch.empty(head.meta_len, dtype=torch.uint8)
            self._recv(buf)
            meta = buf.numpy().tobytes()
        self._owed, self._last = head.nbytes, head
        event = Event(head, meta)
        self._got_closing = closing(event)
        return event

    def receive_payload(self, dest: np.ndarray) -> None:
        """Receive the payload owed straight into ``dest`` (a ring slot's bytes)."""
        self._wait(
            self.link.submit(lambda: self._receive_payload(dest)),
            self._from_leader(),
            "receiving a batch's payload",
        )

    def _receive_payload(self, dest: np.ndarray) -> None:
        if dest.nbytes != self._owed:
            raise ProtocolError(f"a payload of {dest.nbytes} bytes asked, {self._owed} owed")
        self._recv(torch.from_numpy(dest))
        self._owed = 0

    def skip_payload(self) -> None:
        """Receive the payload owed (if any) into nothing: a batch this node will not
        publish, or one a loop left half received (NOTE [closing across nodes])."""
        self._wait(self.link.submit(self._skip), self._from_leader(), "receiving a payload")

    def _skip(self) -> None:
        if self._owed:
            self._recv(torch.empty(self._owed, dtype=torch.uint8))
            self._owed = 0

    def drop_leftover(self, it: int) -> None:
        """A halted loop of iteration ``it`` left a header it asked for: once it came, a
        batch of ``it`` or earlier has its payload taken into nothing at once, so that the
        leader's send of it completes now, not at this node's next iteration."""

        def drop() -> None:
            last = self._last
            if last is not None and last.kind == Kind.BATCH and last.it <= it:
                self._skip()

        with contextlib.suppress(ShmLoaderError):  # the link ended: nothing is left to take
            self.link.submit(drop)

    def drain(self) -> None:
        """After ``close()``: on the link, receive the leader's events into nothing up to its
        closing STOP, so that every send of the leader completes (NOTE [closing across
        nodes]); nothing to do once a job received it or the link broke. Never waits."""

        def drain() -> None:
            while not (self._got_closing or self.broken):
                self._receive_header()
            self._skip()

        with contextlib.suppress(ShmLoaderError):  # the link ended already
            self.link.submit(drain)
        self.link.finish()


def closing(event: Event) -> bool:
    """Whether ``event`` is the leader's closing STOP (NOTE [closing across nodes])."""
    return event.head.kind == Kind.STOP and bool(json_body(event.meta).get("closed"))
