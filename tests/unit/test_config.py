"""Config from the environment: every variable, good and bad values."""

from __future__ import annotations

import dataclasses

import pytest

from shmloader.config import DAEMON_SOCKET, DEFAULT_SLOTS, DEFAULT_SMALL_COPY_BYTES, Config
from shmloader.errors import ConfigError, ShmLoaderError

pytestmark = pytest.mark.timeout(60)


def from_env(**env: str) -> Config:
    return Config.from_env(environ=env)


def test_defaults_with_an_empty_environment() -> None:
    c = from_env()
    # NOTE [finding the daemon]: the environment's default asks the node's daemon
    assert c == Config(daemon=DAEMON_SOCKET)
    # timeout None: the loader follows its process group's timeout (test_lifecycle.py)
    assert (c.enabled, c.slots, c.timeout, c.copy, c.allow_pickle, c.small_copy_bytes) == (
        False,
        DEFAULT_SLOTS,
        None,
        False,
        False,
        DEFAULT_SMALL_COPY_BYTES,
    )
    assert c.runtime_dir is None and c.node is None and c.daemon == DAEMON_SOCKET
    assert Config().daemon is None  # built directly: exactly its arguments


def test_the_daemon_is_found_without_a_variable_and_off_opts_out() -> None:
    """NOTE [finding the daemon]: unset -> the well-known socket (moved by
    SHMLOADER_RUNTIME_DIR), a path -> that one, off -> none."""
    assert from_env().daemon == "/run/shmloader/control.sock"
    assert from_env(SHMLOADER_RUNTIME_DIR="/tmp/rt").daemon == "/tmp/rt/shmloader/control.sock"
    assert from_env(SHMLOADER_DAEMON="/x/c.sock", SHMLOADER_RUNTIME_DIR="/tmp/rt").daemon == (
        "/x/c.sock"
    )
    for off in ("off", "OFF", " 0 ", "false", "no"):
        assert from_env(SHMLOADER_DAEMON=off).daemon is None, off


def test_from_env_reads_os_environ_by_default(monkeypatch) -> None:
    monkeypatch.setenv("SHMLOADER", "1")
    monkeypatch.setenv("SHMLOADER_SLOTS", "6")
    c = Config.from_env()
    assert c.enabled and c.slots == 6


def test_blank_values_mean_unset() -> None:
    c = from_env(
        SHMLOADER="",
        SHMLOADER_SLOTS="  ",
        SHMLOADER_TIMEOUT="",
        SHMLOADER_NODE=" ",
        SHMLOADER_RUNTIME_DIR="",
        SHMLOADER_DAEMON=" ",
        SHMLOADER_COPY="",
        SHMLOADER_SMALL_COPY=" ",
    )
    assert c == Config(daemon=DAEMON_SOCKET)


@pytest.mark.parametrize("var, field", [("SHMLOADER", "enabled"), ("SHMLOADER_COPY", "copy")])
@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" yes ", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_flags(var: str, field: str, raw: str, value: bool) -> None:
    assert getattr(from_env(**{var: raw}), field) is value


@pytest.mark.parametrize("raw, value", [("2", 2), ("8", 8), (" 16 ", 16), ("1000", 1000)])
def test_slots(raw: str, value: int) -> None:
    assert from_env(SHMLOADER_SLOTS=raw).slots == value


@pytest.mark.parametrize("raw, value", [("300", 300.0), ("0.5", 0.5), (" 1e3 ", 1000.0)])
def test_timeout(raw: str, value: float) -> None:
    assert from_env(SHMLOADER_TIMEOUT=raw).timeout == value


def test_names_and_paths() -> None:
    c = from_env(
        SHMLOADER_NODE=" node-1.rack_2:a ",
        SHMLOADER_RUNTIME_DIR="/run/user/1000",
        SHMLOADER_DAEMON="/tmp/d sock/ctl",
    )
    assert c.node == "node-1.rack_2:a"
    assert c.runtime_dir == "/run/user/1000"
    assert c.daemon == "/tmp/d sock/ctl"
    assert from_env(SHMLOADER_NODE="n" * 64).node == "n" * 64


BAD = [
    ("SHMLOADER", "maybe"),
    ("SHMLOADER", "2"),
    ("SHMLOADER", "y"),
    ("SHMLOADER", "enable"),
    ("SHMLOADER_COPY", "2"),
    ("SHMLOADER_COPY", "-1"),
    ("SHMLOADER_SLOTS", "1"),
    ("SHMLOADER_SLOTS", "0"),
    ("SHMLOADER_SLOTS", "-3"),
    ("SHMLOADER_SLOTS", "abc"),
    ("SHMLOADER_SLOTS", "2.5"),
    ("SHMLOADER_SLOTS", "0x10"),
    ("SHMLOADER_TIMEOUT", "0"),
    ("SHMLOADER_TIMEOUT", "-0"),
    ("SHMLOADER_TIMEOUT", "-1"),
    ("SHMLOADER_TIMEOUT", "inf"),
    ("SHMLOADER_TIMEOUT", "-inf"),
    ("SHMLOADER_TIMEOUT", "nan"),
    ("SHMLOADER_TIMEOUT", "1e400"),
    ("SHMLOADER_TIMEOUT", "abc"),
    ("SHMLOADER_TIMEOUT", "5s"),
    ("SHMLOADER_SMALL_COPY", "-1"),
    ("SHMLOADER_SMALL_COPY", "64k"),
    ("SHMLOADER_NODE", "my node"),
    ("SHMLOADER_NODE", "n" * 65),
    ("SHMLOADER_NODE", "a/b"),
    ("SHMLOADER_NODE", "a\0b"),
    ("SHMLOADER_RUNTIME_DIR", "/tmp/a\0b"),
    ("SHMLOADER_DAEMON", "\0"),
]


@pytest.mark.parametrize("var, raw", BAD, ids=[f"{v}={r!r:.12}" for v, r in BAD])
def test_bad_values_name_the_variable_and_the_value(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env(**{var: raw})
    msg = str(info.value)
    assert f"{var}=" in msg
    assert repr(raw) in msg
    assert info.value.name == var and info.value.value == raw
    assert "expected" in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShmLoaderError)


def test_bad_value_is_reported_among_good_ones() -> None:
    with pytest.raises(ConfigError, match="SHMLOADER_TIMEOUT"):
        from_env(SHMLOADER="1", SHMLOADER_SLOTS="3", SHMLOADER_TIMEOUT="never")


def test_overrides_win_over_the_environment() -> None:
    env = {
        "SHMLOADER": "0",
        "SHMLOADER_SLOTS": "8",
        "SHMLOADER_TIMEOUT": "10",
        "SHMLOADER_NODE": "env-node",
        "SHMLOADER_COPY": "1",
    }
    c = Config.from_env(environ=env, enabled=True, slots=3, timeout=2.5, node="kw-node", copy=False)
    assert (c.enabled, c.slots, c.timeout, c.node, c.copy) == (True, 3, 2.5, "kw-node", False)
    c = Config.from_env(environ=env, allow_pickle=True)
    assert c.allow_pickle and c.slots == 8 and c.node == "env-node" and c.copy


def test_unknown_override_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="slot"):
        Config.from_env(environ={}, slot=3)
    with pytest.raises(TypeError):
        Config.from_env(environ={}, SHMLOADER_SLOTS=3)


@pytest.mark.parametrize(
    "kw",
    [
        {"slots": 1},
        {"slots": 0},
        {"slots": True},
        {"slots": 2.0},
        {"slots": "4"},
        {"timeout": 0},
        {"timeout": -1.0},
        {"timeout": float("nan")},
        {"timeout": "5"},
        {"timeout": True},
    ],
    ids=str,
)
def test_direct_construction_is_validated(kw: dict) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**kw)
    assert next(iter(kw)) in str(info.value)
    with pytest.raises(ConfigError):  # overrides go through the same check
        Config.from_env(environ={}, **kw)


def test_config_is_frozen() -> None:
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.slots = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "field,value",
    [
        ("enabled", "0"),
        ("copy", 1),
        ("verify", None),
        ("allow_pickle", "yes"),
        ("node", 3),
        ("runtime_dir", b"/tmp"),
        ("daemon", "/x\0y"),
        ("timeout", float("inf")),
        ("small_copy_bytes", -1),
        ("small_copy_bytes", 1.5),
    ],
)
def test_fields_set_directly_are_validated_too(field, value):
    with pytest.raises(ConfigError, match=field):
        Config(**{field: value})
    with pytest.raises(ConfigError, match=field):
        Config.from_env({}, **{field: value})


def test_small_copy_bytes_from_the_environment() -> None:
    assert from_env(SHMLOADER_SMALL_COPY="0").small_copy_bytes == 0
    assert from_env(SHMLOADER_SMALL_COPY="1048576").small_copy_bytes == 1 << 20
