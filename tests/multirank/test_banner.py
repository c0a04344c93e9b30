"""The sharing line (NOTE [the sharing line] in ``shmloader/_setup/banner.py``)."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch

from shmloader import Config, ConfigError, ShmLoader
from tests.support import ranks
from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("shmloader: sharing")]


def test_one_line_on_stderr_at_the_first_iter_under_default_logging(capsys) -> None:
    loader = ShmLoader(lambda: [torch.ones(2)], None, config=Config.from_env(enabled=True))
    assert _lines(capsys.readouterr().err) == []  # not at construction
    list(loader)
    (line,) = _lines(capsys.readouterr().err)
    assert "sharing off" in line and "no group of more than one rank" in line
    assert "SHMLOADER=1 is set" in line and "SHMLOADER_QUIET=1" in line
    list(loader)
    assert _lines(capsys.readouterr().err) == []  # once per ShmLoader
    loader.close()


def test_an_application_logging_info_gets_a_record_instead(capsys, caplog) -> None:
    caplog.set_level(logging.INFO, logger="shmloader.loader")
    with ShmLoader(lambda: [1], None) as loader:
        list(loader)
    assert _lines(capsys.readouterr().err) == []
    (line,) = _lines("\n".join(caplog.messages))
    assert "sharing off" in line and "SHMLOADER=1 is set" not in line


def test_quiet_silences_it(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SHMLOADER_QUIET", "1")
    with ShmLoader(lambda: [1], None) as loader:
        list(loader)
    with ShmLoader(lambda: [1], None, config=Config(quiet=True)) as loader:
        list(loader)
    assert _lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("raw", ["2", "maybe", "-1"])
def test_a_bad_quiet_value_is_a_config_error_naming_it(raw) -> None:
    with pytest.raises(ConfigError, match="SHMLOADER_QUIET") as info:
        Config.from_env({"SHMLOADER_QUIET": raw})
    assert repr(raw) in str(info.value) or raw in str(info.value)
    with pytest.raises(ConfigError, match="quiet"):
        Config(quiet="yes")  # type: ignore[arg-type]
    assert Config.from_env({"SHMLOADER_QUIET": "on"}).quiet is True
    assert Config.from_env({}).quiet is False


def banner_rank(rank: int, world: int) -> dict:
    group, _ = ranks.sp_groups(world, 2)
    out = {}
    for name, config in (
        ("on", Config.from_env(enabled=True)),
        ("off", Config.from_env(enabled=False)),
        ("quiet", Config.from_env(enabled=True, quiet=True)),
    ):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            loader = ShmLoader(lambda: [torch.ones(2)] * 2, group, config=config)
            built = err.getvalue()
            for _ in range(2):
                list(loader)
            loader.close()
        out[name] = (_lines(built), _lines(err.getvalue()))
    return out


@pytest.mark.timeout(200)
def test_each_sp_leader_says_it_once_and_rank_0_says_sharing_off() -> None:
    out = run_ranks(banner_rank, 4, nodes=[0, 1, 0, 1], timeout=180)
    for rank, o in enumerate(out):
        for name, (at_construction, said) in o.items():
            assert at_construction == [], (rank, name)
            if name == "on" and rank in (0, 2):  # the leaders of [0, 1] and [2, 3]
                (line,) = said
                group = "[0, 1]" if rank == 0 else "[2, 3]"
                assert f"sharing on: SP group {group} on 2 nodes" in line
                assert f"leader rank {rank}" in line and "2 group(s) in a world of 4" in line
                assert "ring in /dev/shm (" in line and "pages" in line
                assert "embedded (no daemon" in line
            elif name == "off" and rank == 0:
                (line,) = said
                assert "sharing off" in line and "SP group [0, 1]" in line
            else:
                assert said == [], (rank, name)
