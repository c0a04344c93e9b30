"""The node leader: receives each batch from the leader and publishes it on its node.

One batch, on a node leader (``_relay``); it is a reader of the leader
(``reader``) and the writer of its node (``writer``)::

    leader                          node leader (node B)          follower (node B)
    ------                          --------------------          -----------------
    xnode.send(meta, slot) =======> xnode.receive_header()
                                    (stamp checked: NOTE [iteration numbers])
                                    _await_readers()
                                    slot' = ring.acquire(n)
                                    xnode.receive_payload(slot')
                                    _announce: hub.publish(BATCH) -> spoke receives BATCH
                                    yield decode(private view)

END, ERROR and STOP from the leader are forwarded to this node's readers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import rng, wire
from .errors import LeaderError
from .reader import _Reader
from .roles import _check_crc, _error_fields, _json_body, _leader_error
from .wire import Kind
from .writer import _Writer
from .xnode import KIND_END, KIND_ERROR, KIND_STOP


class _Relay(_Writer, _Reader):
    """The node leader's loop: the leader's batches, received into this node's ring."""

    def _relay_iteration(self, it: int) -> Iterator[Any]:
        try:
            yield from self._relay(it)
        except GeneratorExit:
            raise
        except LeaderError:
            raise  # already forwarded to this node's readers
        except BaseException as exc:  # e.g. the cross-node link broke: tell our readers
            self._fail(it, exc)
            raise

    def _relay(self, it: int) -> Iterator[Any]:
        xnode, ring = self._xnode, self._ring
        assert xnode is not None and ring is not None
        while True:
            self._check_open()
            t_wait = time.perf_counter()
            head, self._xstash = self._xstash or xnode.receive_header(), None
            self._note_wait(t_wait)
            kind, leader_it, nbytes, meta, draws, crc, epoch, pos = head
            theirs = (leader_it, epoch, pos)
            mine = (it, self._epoch, self._delivered)
            terminal = kind in (KIND_ERROR, KIND_STOP)
            if leader_it < it and not terminal:  # this node left that iteration early
                if nbytes:
                    xnode.receive_payload(np.empty(nbytes, np.uint8))
                self._left_behind(leader_it, pos, kind == KIND_END)
                continue
            if leader_it > it:  # the leader left our iteration: keep its message for the next
                self._xstash = head
                raise self._diverged("left", theirs, mine)
            if kind == KIND_END:
                if (epoch, pos) != mine[1:]:
                    raise self._diverged("ended", theirs, mine)
                self._await_readers(window=False)
                self._tell_readers(self._stamped(Kind.END, it, draws=draws))
                rng.mirror_draws(draws)
                self._exhausted = True
                return
            if terminal:
                body = _json_body(meta)
                if kind == KIND_STOP:
                    reason = str(body.get("reason", ""))
                    self._tell_last(self._stamped(Kind.STOP, it, reason=reason, closed=0))
                    raise self._stopped(reason, theirs, mine)
                body["it"] = it
                self._tell_last(wire.frames(Kind.ERROR, self._seq, **_error_fields(body)))
                raise _leader_error(body, self._topo.leader if self._topo else None)
            if (epoch, pos) != mine[1:]:
                if nbytes:
                    xnode.receive_payload(np.empty(nbytes, np.uint8))
                raise self._diverged("batch", theirs, mine)
            t0 = time.perf_counter_ns()
            self._await_readers()
            slot = ring.acquire(nbytes) if nbytes else None
            if slot is not None:
                xnode.receive_payload(slot.payload[:nbytes])
                if crc >= 0:
                    _check_crc(slot.payload[:nbytes], crc, self._seq)
            self._announce(it, meta, nbytes, slot, draws, time.perf_counter_ns() - t0, crc)
            yield self._deliver(meta, self._own_view(slot, nbytes), draws, t0)
