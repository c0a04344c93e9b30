"""Configuration: one frozen dataclass, built from the environment by default.

Every environment variable is optional. A bad value raises
:class:`~shmloader.errors.ConfigError` naming the variable, the value and what
is accepted, before anything else happens.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

#: Default seconds a rank waits for a peer that is alive but silent. Liveness
#: (pid checks, heartbeats) detects a *dead* peer within about a second
#: whatever this is; the timeout only bounds how long a live but stuck peer is
#: tolerated, so it is generous enough for a slow first batch (worker start,
#: dataset open) on a busy node.
DEFAULT_TIMEOUT_S = 300.0

#: Default ring depth per group and node: how many batches the leader may
#: publish ahead of its slowest follower. Every slot is a batch of shared
#: memory on the node, and the leader's DataLoader already prefetches, so the
#: default keeps just enough to overlap one publish with one step.
DEFAULT_SLOTS = 2


@dataclass(frozen=True)
class Config:
    """How shmloader behaves. ``Config.from_env()`` is the default.

    Attributes:
        enabled: share batches (``SHMLOADER=1``). Off: every rank loads its own.
        slots: ring depth, the batches the leader may run ahead (``SHMLOADER_SLOTS``).
        timeout: seconds to wait for a live but silent peer (``SHMLOADER_TIMEOUT``).
        runtime_dir: parent of the per-job 0700 socket directory
            (``SHMLOADER_RUNTIME_DIR``; default ``$XDG_RUNTIME_DIR`` or ``/tmp``).
        node: node identity override (``SHMLOADER_NODE``), see ``topology``.
        daemon: control socket of ``shmloaderd`` (``SHMLOADER_DAEMON``).
        copy: followers receive owned copies instead of shared views (``SHMLOADER_COPY``).
        verify: checksum every payload end to end, CRC-32 (``SHMLOADER_VERIFY``).
        allow_pickle: pickle leaves the codec does not know. Off by default.
        job: the job's name in ``shmloader stat`` (``SHMLOADER_JOB``, else the
            launcher's run id: ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``).
    """

    enabled: bool = False
    slots: int = DEFAULT_SLOTS
    timeout: float = DEFAULT_TIMEOUT_S
    runtime_dir: str | None = None
    node: str | None = None
    daemon: str | None = None
    copy: bool = False
    verify: bool = False
    allow_pickle: bool = False
    job: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 2:
            raise ConfigError("slots", self.slots, "an integer >= 2")
        # bool is an int: timeout=True would silently mean one second.
        if (
            not isinstance(self.timeout, int | float)
            or isinstance(self.timeout, bool)
            or not self.timeout > 0
        ):
            raise ConfigError("timeout", self.timeout, "a number of seconds > 0")
        if self.timeout == float("inf"):
            raise ConfigError("timeout", self.timeout, "a finite number of seconds")
        for name in ("enabled", "copy", "verify", "allow_pickle"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        for name in ("runtime_dir", "node", "daemon", "job"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "\0" in value):
                raise ConfigError(name, value, "None or a string without NUL bytes")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read ``SHMLOADER*`` variables; keyword arguments win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {
            "enabled": _flag(env, "SHMLOADER"),
            "slots": _int(env, "SHMLOADER_SLOTS", DEFAULT_SLOTS, minimum=2),
            "timeout": _seconds(env, "SHMLOADER_TIMEOUT", DEFAULT_TIMEOUT_S),
            "runtime_dir": _path(env, "SHMLOADER_RUNTIME_DIR"),
            "node": _name(env, "SHMLOADER_NODE"),
            "daemon": _path(env, "SHMLOADER_DAEMON"),
            "copy": _flag(env, "SHMLOADER_COPY"),
            "verify": _flag(env, "SHMLOADER_VERIFY"),
            "job": _job(env),
        }
        known = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in known:
                raise TypeError(f"Config has no field {key!r}; fields are {sorted(known)}")
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
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


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
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


def _name(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip()
    if len(value) > 64 or not all(c.isalnum() or c in "-_.:" for c in value):
        raise ConfigError(name, raw, "up to 64 characters of letters, digits, '-', '_', '.', ':'")
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
