"""Every exception shmloader raises, all derived from :class:`ShmLoaderError`.

So ``except ShmLoaderError`` catches everything the library itself decided to
raise. Messages name the value at fault and say how to fix it: a user reading
one in a 1000-rank job log should not need the source to act on it. The ground
layer: it imports nothing of shmloader.
"""

from __future__ import annotations


class ShmLoaderError(Exception):
    """Base class of every error raised by shmloader."""


class ConfigError(ShmLoaderError, ValueError):
    """A setting (environment variable or ``Config`` field) has a bad value.

    The message names the variable, the value and what is accepted.
    """

    def __init__(self, name: str, value: object, accepted: str) -> None:
        self.name = name
        self.value = value
        self.accepted = accepted
        super().__init__(f"{name}={value!r} is not valid: expected {accepted}")


class ConfigMismatchError(ConfigError):
    """Ranks of one group constructed their ``ShmLoader`` with different settings.

    ``name`` is the setting, ``value`` the values by rank, ``accepted`` the fix.
    Raised at set-up, before any collective (NOTE [set-up marks] in ``arrival``).
    """

    def __init__(self, name: str, values: dict[int, object], fix: str) -> None:
        self.name = name
        self.value = values
        self.accepted = fix
        shown = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(values.items()))
        ShmLoaderError.__init__(self, f"ranks disagree on {name} ({shown}): {fix}")


class UnsupportedBatchError(ShmLoaderError, TypeError):
    """A batch holds something the codec cannot carry without pickle.

    Raised on the leader before a single byte is written, with the path of the
    offending leaf (``batch['meta'][3]``) and its type.
    """

    def __init__(self, path: str, obj: object, why: str = "", fix: str = "") -> None:
        self.path = path
        self.type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        reason = why or "only tensors, numpy arrays, int/float/bool/str/bytes/None leaves"
        fix = fix or (
            "Convert it in your collate_fn (e.g. to a tensor or a str), or opt in to "
            "pickling it with ShmLoader(..., config=Config.from_env(allow_pickle=True)) on "
            "every rank (from_env keeps SHMLOADER and the other variables; a bare Config() "
            "does not read the environment)."
        )
        super().__init__(
            f"{path} is a {self.type_name}, which shmloader cannot share: {reason}. {fix}"
        )


class LeaderError(ShmLoaderError):
    """The group leader's loader raised; followers raise this instead of hanging.

    Carries the original exception's type name, message and formatted
    traceback text (``original_type``, ``original_message``, ``traceback_text``).
    """

    def __init__(
        self,
        original_type: str,
        original_message: str,
        traceback_text: str,
        *,
        leader_rank: int | None = None,
    ) -> None:
        self.original_type = original_type
        self.original_message = original_message
        self.traceback_text = traceback_text
        self.leader_rank = leader_rank
        where = f" on rank {leader_rank}" if leader_rank is not None else ""
        super().__init__(
            f"the leader's loader{where} raised {original_type}: {original_message}\n"
            f"--- leader traceback ---\n{traceback_text}"
        )


class PeerLostError(ShmLoaderError):
    """A peer process died or stayed silent past ``SHMLOADER_TIMEOUT``."""

    def __init__(self, rank: int | None, role: str, detail: str) -> None:
        self.rank = rank
        self.role = role
        self.detail = detail
        who = f"{role} rank {rank}" if rank is not None else role
        super().__init__(
            f"lost {who}: {detail}. If that process is merely slow (a slow dataset, a "
            "long first batch), raise SHMLOADER_TIMEOUT; otherwise look at its log for "
            "the reason it died."
        )


class LeaderStoppedError(LeaderError):
    """The leader's iteration stopped (``KeyboardInterrupt``/``SystemExit`` inside
    its loader): followers' epochs did not end, so they raise this instead of
    ending their loop as if the epoch were complete.

    ``leader_position`` and ``position`` are ``(iteration, epoch, batch)`` of the
    leader when it stopped and of this rank when it learnt it.
    """

    def __init__(
        self,
        reason: str,
        *,
        leader_rank: int | None,
        leader_position: tuple[int, int, int] | None,
        position: tuple[int, int, int],
    ) -> None:
        self.leader_position = leader_position
        self.position = position
        where = (
            f"at batch {leader_position[2]} of epoch {leader_position[1]} "
            f"(iteration {leader_position[0]})"
            if leader_position is not None
            else "mid-epoch"
        )
        super().__init__(
            "LeaderStopped",
            f"the leader stopped ({reason}) {where}; this rank had received "
            f"{position[2]} batches of epoch {position[1]} (iteration {position[0]}), "
            "so its epoch did not end: stop this rank too",
            "",
            leader_rank=leader_rank,
        )


class DivergenceError(ShmLoaderError):
    """Ranks of one group iterate differently: one left an epoch the other did not,
    or they are at different epochs or positions.

    Every rank of a group must iterate the same way (same ``set_epoch`` calls,
    same early ``break``s, same resume). ``leader_position`` and ``position``
    are ``(iteration, epoch, batch)`` of the writer and of this rank.
    """

    def __init__(
        self,
        what: str,
        *,
        rank: int | None,
        leader_rank: int | None,
        leader_position: tuple[int, int, int],
        position: tuple[int, int, int],
    ) -> None:
        self.rank = rank
        self.leader_rank = leader_rank
        self.leader_position = leader_position
        self.position = position
        lit, lep, lpos = leader_position
        it, ep, pos = position
        super().__init__(
            f"ranks of one group diverged: {what}. The writer (rank {leader_rank}) is at "
            f"iteration {lit}, epoch {lep}, batch {lpos}; this rank ({rank}) is at iteration "
            f"{it}, epoch {ep}, batch {pos}. Every rank of a group must iterate the same way: "
            "the same set_epoch() calls, the same early breaks, the same load_state_dict()"
        )


class ShmCapacityError(ShmLoaderError, MemoryError):
    """Shared memory cannot hold what is asked of it (``/dev/shm`` or node budget)."""

    def __init__(self, needed: int, free: int | None, where: str, fix: str = "") -> None:
        self.needed = needed
        self.free = free
        free_text = "unknown" if free is None else _human(free)
        fix = fix or (
            "give the container more shared memory (docker run --shm-size=..., or a "
            "larger tmpfs on /dev/shm), or lower SHMLOADER_SLOTS"
        )
        super().__init__(
            f"{where}: needed {_human(needed)} ({needed} bytes) of shared memory but only "
            f"{free_text} is free; {fix}"
        )


class TopologyMismatchError(ShmLoaderError, ValueError):
    """Ranks disagree about the group, or a checkpoint does not fit the current ranks."""


class LoaderStateError(ShmLoaderError, RuntimeError):
    """A call that the loader's current state does not allow (e.g. loading a
    checkpoint after iteration started)."""


class ProtocolError(ShmLoaderError):
    """A message or segment failed validation (magic, version, token, bounds).

    Raised only internally: receivers log and drop such messages.
    """


def _human(n: int) -> str:
    """Bytes as a short human string: ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


human_bytes = _human
