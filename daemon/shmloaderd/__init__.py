"""shmloaderd: the optional per-node daemon of shmloader.

It owns the node's shared-memory budget (``admit``), reaps what crashed jobs
leave in /dev/shm, keeps optional warm (pre-touched) segments and
reports what is cached (``shmloader stat``). The library never requires it.

Modules: ``protocol`` (the control wire format, pure), ``registry`` (jobs and
the budget), ``warm`` (warm segments), ``server`` (the loop: socket, reaper,
watchdog), ``notify`` (sd_notify), ``metrics`` (Prometheus), ``__main__``
(command line).
"""

from ._version import __version__

__all__ = ["__version__"]
