"""Closing one ``ShmLoader``: ``Closing``, every step of it, in order, once, from any thread.

It owns the closing sequence (``free``: the reporter, the device stage, the
role's goodbyes, then what set-up made, in ``Built.closers``' order) and who
runs it (NOTE [one owner] in ``_roles.base``): the producer once it left its
iteration, or the caller where no producer ever ran or ``close()`` took the
resources from a producer that was away. It is the counterpart of ``build``;
it imports the roles' contract and the producer, never ``loader``.
"""

from __future__ import annotations

import os
import threading

from .._roles.base import Owner, Role
from .._roles.producer import Producer
from ..device.stage import DeviceStage
from .build import Built, close_quietly


class Closing:
    """Every step of closing one ``ShmLoader``, in order, once, from any thread.

    ``close()`` calls it, and so does the loader's finalizer (``dropped``: a
    loader dropped unclosed, or at exit, ``at_exit``, which says no goodbye;
    nothing in a forked child). Whoever owns the resources frees them (NOTE [one
    owner] in ``_roles.base``): the producer, once it left its iteration, or
    the caller, where no producer ever ran or ``close()`` took them from a
    producer that was away. It refers to what set-up made, never to the
    ``ShmLoader``: a loader the user drops is freed at once and its finalizer
    runs then, not at the next cycle collection.
    """

    def __init__(
        self,
        owner: Owner,
        producer: Producer | None,
        stage: DeviceStage | None,
        role: Role,
        built: Built,
    ) -> None:
        self.creator = os.getpid()
        self.owner, self.producer, self.stage = owner, producer, stage
        self.role, self.built = role, built
        self.goodbye = True
        self._freed = threading.Lock()  # held by whoever frees: it happens once

    def dropped(self) -> None:
        """The loader's finalizer: a loader dropped unclosed while the program runs says its
        goodbyes as ``close()`` does (peers end their iteration, a node leader drains the
        leader's sends), on the thread that dropped it and waiting as ``close()`` waits (a
        few seconds at most where a peer does not answer); at exit (the main thread has
        ended, peers may be gone) it says none. Nothing in a forked child."""
        if os.getpid() != self.creator:
            return
        self(at_exit=not threading.main_thread().is_alive())

    def __call__(self, *, at_exit: bool = False) -> None:
        if at_exit and os.getpid() != self.creator:
            return
        if not self.owner.close():  # closed already
            return
        self.goodbye = not at_exit
        producer = self.producer
        if producer is not None:
            producer.stop()  # it leaves its iteration at its next check
            if producer.started:
                if producer.on_its_thread():  # a finalizer on the producer: it frees when back
                    return
                if producer.finish():  # it said its goodbyes and freed what it owns
                    return
        with self.owner.closing():  # no producer ever ran, or it was away: ours now
            self.free()

    def free(self) -> None:
        """The closing sequence itself: the peers told, then everything freed."""
        if not self._freed.acquire(blocking=False):
            return
        built, goodbye = self.built, self.goodbye
        if built.reporter is not None and goodbye:
            built.reporter.close()
        if self.stage is not None:  # copies in flight finish; unregister before unmap
            close_quietly([self.stage.close])
        if goodbye:
            self.role.close()  # a follower's BYE, a writer's STOP
        close_quietly(built.closers)
        if built.source is not None:
            built.source.loader = None
