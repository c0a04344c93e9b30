"""A follower: maps what its node's writer published.

One batch, on a follower (``_follower_iteration``)::

    writer                          follower
    ------                          --------
    hub.publish(BATCH) --ZeroMQ---> _next_event: spoke receives BATCH
                                    (stamp checked: NOTE [iteration numbers])
                    <----ACK------- took batch seq
                    <--ATTACHED---- _attach: first map of the segment
                                    mmap slot MAP_PRIVATE (_map)
                                    yield codec.decode(view)
                                    ... batch garbage ->
    ring.release  <--RELEASE------- weakref.finalize (_Releaser, NOTE [prompt release])
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import rng, wire
from .channel import Spoke
from .errors import PeerLostError, ProtocolError, ShmLoaderError
from .reader import _Reader
from .release import announced_words
from .roles import CLOSE_WAIT_S, _check_crc, _leader_error, log
from .wire import Kind


class _Releaser:
    """A reader's outgoing messages, and its RELEASEs sent the moment a batch dies.

    NOTE [prompt release]
        A reader's batch dies (``weakref.finalize`` on its mapping) when the
        user drops it, typically when ``batch`` is rebound at the top of the
        next step. Sending RELEASE right then, instead of with the reader's
        next request, lets the writer reuse that slot for the very next
        batch, so a lockstep job needs two slots, not three.

    NOTE [one thread per socket]
        ZeroMQ sockets are not thread-safe, and a finalizer runs on whichever
        thread drops the last reference (a prefetch thread iterates while
        the main thread drops batches; a garbage collection runs finalizers
        anywhere, even inside one of our own socket calls). So:

        - the *owner* is the thread that iterates: every ``next()`` claims
          the socket for its thread (``claim``);
        - a finalizer only appends to ``pending`` (a deque: atomic appends),
          and sends at once only when it runs on the owner thread and takes
          ``lock`` without blocking, i.e. when no socket call is under way;
        - every socket call holds ``lock`` and first flushes ``pending``, and
          a wait flushes it once per slice: releases queued by other threads
          leave with the owner's next call or within one slice of a wait.
    """

    def __init__(self, spoke: Spoke, rank: int) -> None:
        self.spoke = spoke
        self.rank = rank
        self.pending: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.holder = 0  # the thread holding ``lock``, 0 when free
        self.owner = threading.get_ident()
        self.closed = False  # after close(): batches that die later release nothing

    def claim(self) -> None:
        """The calling thread iterates: it owns the socket from now on."""
        self.owner = threading.get_ident()

    def release(self, item: tuple[int, int, int]) -> None:
        """The finalizer callback: queue, and send now when that is safe."""
        if self.closed:
            return
        self.pending.append(item)
        if threading.get_ident() == self.owner and self.lock.acquire(blocking=False):
            self.holder = threading.get_ident()
            try:
                self._flush()
            finally:
                self.holder = 0
                self.lock.release()

    def send(self, parts: list) -> None:
        """Send ``parts`` (if any) after every queued RELEASE."""
        me = threading.get_ident()
        if self.holder == me:  # inside our own wait (a handler): the socket is ours
            self._flush()
            if parts:
                self.spoke.send(parts)
            return
        with self._holding():
            self._flush()
            if parts:
                self.spoke.send(parts)

    def flush(self) -> None:
        """Send what other threads queued; only from inside ``receiving``."""
        if self.holder == threading.get_ident():
            self._flush()

    def close(self) -> None:
        """Close the socket; batches that die later release nothing (NOTE [held past close])."""
        self.closed = True
        self.pending.clear()
        self.spoke.close()

    def _flush(self) -> None:
        while self.pending and not self.closed:
            try:
                index, gen, seq = self.pending.popleft()
            except IndexError:
                return
            self.spoke.send(wire.frames(Kind.RELEASE, seq, rank=self.rank, slot=index, gen=gen))

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        if not self.lock.acquire(timeout=CLOSE_WAIT_S):
            raise ShmLoaderError(
                "a reader's socket stayed busy for 10 s: two threads iterate one ShmLoader "
                "at once; iterate it from one thread (a prefetch thread is fine)"
            )
        self.holder = threading.get_ident()
        try:
            yield
        finally:
            self.holder = 0
            self.lock.release()

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Hold the socket for a wait; finalizers meanwhile only queue."""
        with self._holding():
            self._flush()
            yield


class _Follower(_Reader):
    """The follower's loop: BATCH messages of its node's writer, mapped."""

    def _next_event(self, it: int) -> wire.Message:
        """The next message that matters to iteration ``it`` (NOTE [iteration numbers], loader).

        That is a message of iteration ``it``, the writer's last word (ERROR,
        STOP) or a message of a later iteration (then also kept in
        ``_stash`` for the next one). Leftovers of earlier iterations are
        ACKed and released right here, inside the receive path: the writer
        may be waiting for exactly those.
        """
        spoke, topo = self._spoke, self._topo
        assert spoke is not None and topo is not None
        self._out.claim()  # NOTE [one thread per socket]: the iterating thread owns it
        if self._stash is not None:
            msg, self._stash = self._stash, None
            if self._sort(msg, it):
                return msg
        found: list[wire.Message] = []

        def handle(msg: wire.Message, _rank: int | None) -> bool:
            if self._sort(msg, it):
                found.append(msg)
                return True
            return False

        peer = self._peer(topo.writer)
        t0 = time.perf_counter()
        with self._out.receiving():
            spoke.wait(
                handle,
                lambda: [peer],
                timeout=self.config.timeout,
                doing=f"waiting for batch {self._delivered} of iteration {it}",
                idle=self._out.flush,
            )
        self._note_wait(t0)
        return found[0]

    def _sort(self, msg: wire.Message, it: int) -> bool:
        """Whether ``msg`` ends the wait for iteration ``it``; drop an earlier one's leftovers."""
        terminal = msg.kind in (Kind.ERROR, Kind.STOP)
        if terminal:  # the writer waits (bounded) until it knows we have it: _tell_last
            self._out.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
        msg_it = msg.body.get("it", it)
        if msg_it == it:
            return True
        closed = msg.kind == Kind.STOP and msg["closed"]
        if terminal and (msg_it < it or closed):  # the writer's last word, in any iteration
            return True
        if msg_it > it:  # the writer moved on: keep the message for the next iteration
            self._stash = msg
            return True
        self._drop(msg)
        if msg.kind in (Kind.BATCH, Kind.END):
            self._left_behind(msg_it, msg["pos"], msg.kind == Kind.END)
        return False

    def _drop(self, msg: wire.Message) -> None:
        """ACK and RELEASE a batch this rank will not use (its iteration is over)."""
        if msg.kind != Kind.BATCH:
            return
        self._out.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
        if msg["slot"] >= 0:
            self._attach(msg["seg"])
            words = announced_words(msg.body)
            if words is not None:  # never mapped: nothing of it can change under us
                self._reader.release_now(words)  # type: ignore[union-attr]
            self._out.pending.append((msg["slot"], msg["gen"], msg.seq))
            self._out.send([])

    def _attach(self, seg: str) -> None:
        assert self._reader is not None and self._spoke is not None
        try:
            opened = self._reader.open(seg)
        except ProtocolError as exc:
            writer = self._peer(self._topo.writer) if self._topo else None
            if writer is not None and not writer.alive():
                raise PeerLostError(
                    writer.rank, writer.role, f"it died before we mapped {seg}"
                ) from None
            raise ShmLoaderError(
                f"cannot map the batch in {seg}: {exc}. The writer may have closed its ShmLoader "
                "while this rank was still iterating: close() every rank's loader only after "
                "every rank finished iterating"
            ) from None
        if opened:
            self._out.send(wire.frames(Kind.ATTACHED, rank=self._me, seg=seg))

    def _follower_iteration(self, it: int) -> Iterator[Any]:
        reader, spoke, topo = self._reader, self._spoke, self._topo
        assert reader is not None and spoke is not None and topo is not None
        while True:
            self._check_open()
            msg = self._next_event(it)
            mine = (it, self._epoch, self._delivered)
            theirs = (msg.body.get("it", it), msg.body.get("epoch", -1), msg.body.get("pos", -1))
            if msg is self._stash:  # a later iteration started while we still iterate
                raise self._diverged("left", theirs, mine)
            if msg.kind == Kind.END:
                if theirs[1:] != mine[1:]:
                    raise self._diverged("ended", theirs, mine)
                rng.mirror_draws(msg["draws"])
                self._exhausted = True
                return
            if msg.kind == Kind.STOP:
                if msg["closed"]:
                    self._writer_closed = True
                    raise PeerLostError(
                        topo.writer,
                        topo.role(topo.writer),
                        "it closed its ShmLoader while this rank was still iterating",
                    )
                raise self._stopped(msg["reason"], theirs, mine)
            if msg.kind == Kind.ERROR:
                raise _leader_error(msg.body, topo.leader)
            if msg.kind != Kind.BATCH:
                log.warning("shmloader: unexpected %s from the writer; ignored", msg.kind.name)
                continue
            if theirs[1:] != mine[1:]:
                self._drop(msg)
                raise self._diverged("batch", theirs, mine)
            t0 = time.perf_counter_ns()
            self._out.send(wire.frames(Kind.ACK, msg.seq, rank=self._me))
            yield self._deliver(msg.blob, self._map(msg), msg["draws"], t0)

    def _map(self, msg: wire.Message) -> np.ndarray:
        """A private view of the payload a BATCH announced (empty without payload)."""
        nbytes = msg["nbytes"]
        if not nbytes:
            return np.empty(0, np.uint8)
        assert self._reader is not None
        self._attach(msg["seg"])
        release = functools.partial(self._out.release, (msg["slot"], msg["gen"], msg.seq))
        payload = self._reader.view(msg["seg"], nbytes, release, announced_words(msg.body))
        if msg["crc"] >= 0:
            _check_crc(payload, msg["crc"], msg.seq)
        return payload
