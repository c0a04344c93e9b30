"""shmloaderd: the optional per-node daemon of shmloader; the library never requires it.

It owns the node's shared-memory budget (``admit``), the reaping of what crashed
jobs leave in the ring directories, an optional warm pool of pre-touched
segments and the node's report of what is cached (``shmloader stat``). Its
modules: ``protocol`` (the control wire format, pure), ``registry`` (jobs and
the budget), ``pool`` (the warm pool), ``server`` (the loop: socket, reaper,
watchdog), ``tenants`` and ``guard`` (node mode), ``notify`` (sd_notify),
``metrics`` (Prometheus) and ``__main__`` (the command line).
"""

from ._version import __version__

__all__ = ["__version__"]
