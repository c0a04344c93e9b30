"""Configuration: one frozen dataclass, built from the environment by default.

It owns ``Config`` and ``Config.from_env()``: every ``SHMLOADER*`` variable,
each optional, validated before anything else happens (a bad value is a
:class:`~shmloader.errors.ConfigError` naming the variable, the value and what
is accepted), and where a job looks for the node's daemon (``daemon_socket``,
NOTE [finding the daemon]). It reads the environment and checks the ring
directory (``ringdir``), and touches nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._node import ringdir
from .errors import ConfigError

#: Seconds a rank waits for a peer that is alive but silent when neither
#: ``SHMLOADER_TIMEOUT`` nor the process group says otherwise: torch's own
#: default process-group timeout (30 min). Liveness (pid checks) detects a
#: *dead* peer within about a second whatever this is; the timeout only bounds
#: how long a live but busy peer is tolerated. By default (``timeout=None``) a
#: ShmLoader follows its process group's timeout (``loader.group_timeout``),
#: so a leader that evaluates or checkpoints alone is tolerated exactly as long
#: as the training job's own collectives would tolerate it.
DEFAULT_TIMEOUT_S = 1800.0

#: Leaves of at most this many bytes are delivered as owned copies rather than
#: views of the shared slot, so that keeping one (labels for an epoch-level
#: metric) keeps nothing else of the batch alive. Copying 64 KiB costs a few
#: microseconds; the slot's memory is what a kept view would pin.
DEFAULT_SMALL_COPY_BYTES = 64 << 10

#: Default ring depth per group and node: how many batches the leader may
#: publish ahead of its slowest follower. Every slot is a batch of shared
#: memory on the node, and the leader's DataLoader already prefetches, so the
#: default keeps just enough to overlap one publish with one step.
DEFAULT_SLOTS = 2

# -- device delivery (shmloader.device.stage) --------------------------------------
#: Default device of delivered batches: today's host-memory views.
DEFAULT_DEVICE = "cpu"
#: Default batches copied to the device ahead of the one the user holds.
DEFAULT_PREFETCH = 2
_DEVICE_ACCEPTED = "'cpu', 'cuda', 'cuda:N' (N >= 0) or 'auto'"

# -- the node daemon ---------------------------------------------------------------
#: The control socket of the node's ``shmloaderd`` (the systemd unit's
#: ``RuntimeDirectory``), where every job looks for it (NOTE [finding the daemon]).
DAEMON_SOCKET = "/run/shmloader/control.sock"
#: ``SHMLOADER_DAEMON`` values that keep a job from asking any daemon.
DAEMON_OFF = ("off", "0", "false", "no")


# NOTE [finding the daemon]
#     A node daemon budgets only the jobs that ask it, so a job asks it without
#     being told: with ``SHMLOADER_DAEMON`` unset, at the well-known socket
#     ``/run/shmloader/control.sock`` (``$SHMLOADER_RUNTIME_DIR/shmloader/control.sock``
#     where ``SHMLOADER_RUNTIME_DIR`` is set: the runtime directory moves it
#     like every other socket of shmloader's, which is also how the test suite
#     keeps its jobs away from a daemon the machine may run). A path in
#     ``SHMLOADER_DAEMON`` asks that daemon instead; ``SHMLOADER_DAEMON=off`` asks
#     none, and the sharing line says so. Finding costs nothing where no daemon
#     runs: a socket file that does not exist is one ``stat()``, no connection,
#     no wait, and nothing is logged. A job whose daemon is not there (yet) runs
#     embedded and asks again: at once when the socket file appears, after the
#     backoff of NOTE [daemon restarts] (``daemon_client``) when it exists but does
#     not answer; once it answers, the job registers its ring as a restarted
#     daemon is told it, and every admission from then on is checked.
def well_known_socket(environ: Mapping[str, str] | None = None) -> str:
    """Where a job looks for the node's daemon when ``SHMLOADER_DAEMON`` is unset
    (NOTE [finding the daemon])."""
    env = os.environ if environ is None else environ
    base = (env.get("SHMLOADER_RUNTIME_DIR") or "").strip()
    return os.path.join(base, "shmloader", "control.sock") if base else DAEMON_SOCKET


def daemon_socket(environ: Mapping[str, str] | None = None) -> str | None:
    """The daemon socket a job asks: ``SHMLOADER_DAEMON``, None for ``off``, else the
    well-known socket (NOTE [finding the daemon])."""
    env = os.environ if environ is None else environ
    raw = env.get("SHMLOADER_DAEMON")
    if raw is None or raw.strip() == "":
        return well_known_socket(env)
    if raw.strip().lower() in DAEMON_OFF:
        return None
    if "\0" in raw:
        raise ConfigError(
            "SHMLOADER_DAEMON", raw, "a socket path without NUL bytes, or off (no daemon)"
        )
    return raw


def valid_device(value: object) -> bool:
    """Whether ``value`` names a device ``ShmLoader`` accepts (``_DEVICE_ACCEPTED``)."""
    if not isinstance(value, str):
        return False
    if value in ("cpu", "cuda", "auto"):
        return True
    head, _, index = value.partition(":")
    return head == "cuda" and index.isdigit() and index == str(int(index))


@dataclass(frozen=True)
class Config:
    """How shmloader behaves. ``Config.from_env()`` is the default.

    Attributes:
        enabled: share batches (``SHMLOADER=1``). Off: every rank loads its own.
        slots: ring depth, the batches the leader may run ahead (``SHMLOADER_SLOTS``).
        timeout: seconds to wait for a live but silent peer (``SHMLOADER_TIMEOUT``);
            ``None`` (the default): the process group's own timeout, else
            ``DEFAULT_TIMEOUT_S``. The same bound applies to set-up: a rank that
            does not construct its ShmLoader within it is named in a
            ``PeerLostError`` on the others.
        runtime_dir: parent of the per-job 0700 socket directory
            (``SHMLOADER_RUNTIME_DIR``; default ``$XDG_RUNTIME_DIR`` or ``/tmp``).
        node: node identity override (``SHMLOADER_NODE``), see ``topology``.
        daemon: control socket of the node's ``shmloaderd``; ``None``: no daemon.
            ``from_env``: ``SHMLOADER_DAEMON``, ``off`` for none, unset for the
            well-known socket (NOTE [finding the daemon]). A ``Config`` built
            directly asks no daemon unless given one.
        copy: followers receive owned copies instead of shared views (``SHMLOADER_COPY``).
        verify: checksum every payload end to end, CRC-32 (``SHMLOADER_VERIFY``).
        allow_pickle: pickle leaves the codec does not know. Off by default.
        device: where delivered tensors live (``SHMLOADER_DEVICE``): ``cpu``
            (the default), ``cuda``, ``cuda:N`` or ``auto``; see ``shmloader.device.which``.
        prefetch: batches copied to the device ahead of the one the user
            holds (``SHMLOADER_PREFETCH``, default 2); only with a CUDA device.
        small_copy_bytes: leaves of at most this many bytes are owned copies, not
            views of shared memory (``SHMLOADER_SMALL_COPY``; 0: none).
        job: the job's name in ``shmloader stat`` (``SHMLOADER_JOB``, else the
            launcher's run id: ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``).
        collate_in_slot: DataLoader workers collate straight into their ring
            slot (``SHMLOADER_COLLATE_IN_SLOT``, on by default; NOTE [collate
            into the slot] in ``shmloader._workers.collate``). Off: one copy after the collate.
        shm_dir: the directory that holds the ring's segments (``SHMLOADER_SHM_DIR``,
            default ``/dev/shm``): a tmpfs mounted with ``huge=within_size`` makes a
            huge-page ring (NOTE [huge-page ring] in ``shmloader._node.ringdir``). Every
            rank of a group sets the same one; it must exist, belong to you or
            root, and be safe from other users (sticky when others may write).
        quiet: no line at the first ``iter()`` saying whether sharing is on
            (``SHMLOADER_QUIET=1``; NOTE [the sharing line] in ``shmloader._setup.banner``).
        ahead: each rank's per-batch work (the leader's publish and cross-node
            send, a node leader's receive, a follower's map) runs on a background
            thread, up to ``slots`` batches ahead of the user (``SHMLOADER_AHEAD``,
            on by default; NOTE [running ahead] in ``shmloader._roles.producer``). The
            leader runs ahead only for a DataLoader with workers.

    A ``Config`` built directly holds exactly its arguments: it does not read
    the environment, so ``Config(allow_pickle=True)`` means sharing off
    (``enabled=False``) even under ``SHMLOADER=1``. To change one setting and
    keep the launcher's, use ``Config.from_env(allow_pickle=True)``.
    """

    enabled: bool = False
    slots: int = DEFAULT_SLOTS
    timeout: float | None = None
    runtime_dir: str | None = None
    node: str | None = None
    daemon: str | None = None
    copy: bool = False
    verify: bool = False
    allow_pickle: bool = False
    device: str = DEFAULT_DEVICE
    prefetch: int = DEFAULT_PREFETCH
    small_copy_bytes: int = DEFAULT_SMALL_COPY_BYTES
    job: str | None = None
    collate_in_slot: bool = True
    shm_dir: str = ringdir.DEFAULT
    quiet: bool = False
    ahead: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 2:
            raise ConfigError("slots", self.slots, "an integer >= 2")
        # bool is an int: timeout=True would silently mean one second.
        if self.timeout is not None and (
            not isinstance(self.timeout, int | float)
            or isinstance(self.timeout, bool)
            or not self.timeout > 0
        ):
            raise ConfigError("timeout", self.timeout, "a number of seconds > 0")
        if self.timeout == float("inf"):
            raise ConfigError("timeout", self.timeout, "a finite number of seconds")
        small = self.small_copy_bytes
        if not isinstance(small, int) or isinstance(small, bool) or small < 0:
            raise ConfigError("small_copy_bytes", small, "an integer >= 0 (bytes)")
        for name in (
            *("enabled", "copy", "verify", "allow_pickle", "collate_in_slot", "quiet"),
            "ahead",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        for name in ("runtime_dir", "node", "daemon", "job"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "\0" in value):
                raise ConfigError(name, value, "None or a string without NUL bytes")
        if not valid_device(self.device):
            raise ConfigError("device", self.device, _DEVICE_ACCEPTED)
        prefetch = self.prefetch
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ConfigError("prefetch", prefetch, "an integer >= 1")
        if self.shm_dir != ringdir.DEFAULT:
            ringdir.check(self.shm_dir, "shm_dir")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read ``SHMLOADER*`` variables; keyword arguments win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {
            "enabled": _flag(env, "SHMLOADER"),
            "slots": _int(env, "SHMLOADER_SLOTS", DEFAULT_SLOTS, minimum=2),
            "timeout": _seconds(env, "SHMLOADER_TIMEOUT", None),
            "runtime_dir": _path(env, "SHMLOADER_RUNTIME_DIR"),
            "node": _name(env, "SHMLOADER_NODE"),
            "daemon": daemon_socket(env),
            "copy": _flag(env, "SHMLOADER_COPY"),
            "verify": _flag(env, "SHMLOADER_VERIFY"),
            "device": _device(env, "SHMLOADER_DEVICE"),
            "prefetch": _int(env, "SHMLOADER_PREFETCH", DEFAULT_PREFETCH, minimum=1),
            "small_copy_bytes": _int(
                env, "SHMLOADER_SMALL_COPY", DEFAULT_SMALL_COPY_BYTES, minimum=0
            ),
            "job": _job(env),
            "collate_in_slot": _flag(env, "SHMLOADER_COLLATE_IN_SLOT", default=True),
            "shm_dir": _shm_dir(env),
            "quiet": _flag(env, "SHMLOADER_QUIET"),
            "ahead": _flag(env, "SHMLOADER_AHEAD", default=True),
        }
        known = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in known:
                raise TypeError(f"Config has no field {key!r}; fields are {sorted(known)}")
        values.update(overrides)
        config = cls(**values)  # type: ignore[arg-type]
        object.__setattr__(config, "_from_env", True)  # see ShmLoader's SHMLOADER check
        return config


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(name, raw, "1/0 (also true/false, yes/no, on/off)")


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(name, raw, f"an integer >= {minimum}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ConfigError(name, raw, "a finite number of seconds > 0, e.g. 300 or 0.5")
    return value


def _path(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    if "\0" in raw:
        raise ConfigError(name, raw, "a filesystem path without NUL bytes")
    return raw


def _shm_dir(env: Mapping[str, str]) -> str:
    raw = env.get("SHMLOADER_SHM_DIR")
    if raw is None or raw.strip() == "":
        return ringdir.DEFAULT
    return ringdir.check(raw, "SHMLOADER_SHM_DIR")


def _name(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip()
    if len(value) > 64 or not all(c.isalnum() or c in "-_.:" for c in value):
        raise ConfigError(name, raw, "up to 64 characters of letters, digits, '-', '_', '.', ':'")
    return value


def _device(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return DEFAULT_DEVICE
    value = raw.strip().lower()
    if not valid_device(value):
        raise ConfigError(name, raw, _DEVICE_ACCEPTED)
    return value


#: Where a job's name comes from, first set wins: ours, then the launchers' run ids.
JOB_VARIABLES = ("SHMLOADER_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def _job(env: Mapping[str, str]) -> str | None:
    """The job name for ``shmloader stat``; a launcher's id is shown as it is (printable, 128)."""
    for name in JOB_VARIABLES:
        raw = env.get(name, "").strip()
        if raw:
            value = "".join(c if c.isprintable() else "?" for c in raw)[:128]
            if name == "SHMLOADER_JOB" and value != raw:
                raise ConfigError(name, raw, "up to 128 printable characters")
            return value
    return None
