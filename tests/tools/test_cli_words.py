"""What the commands say of themselves: the version, the socket's mode, the retry's wait."""

from __future__ import annotations

import logging
import re

import pytest

import shmloader
from shmloader._transport.daemon_client import DaemonClient
from shmloader.tools import cli


@pytest.mark.parametrize(
    ("argv", "prog"),
    [(["--version"], "shmloader"), (["daemon", "--version"], "shmloaderd")],
)
def test_both_commands_print_the_packages_version(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"{prog} {shmloader.__version__}\n"


def test_the_socket_help_says_node_modes_directory_mode() -> None:
    from shmloaderd.__main__ import build_parser

    (socket,) = (a for a in build_parser()._actions if "--socket" in a.option_strings)
    assert "0755 in node mode" in (socket.help or "")


def test_a_lost_daemon_is_tried_again_after_whole_seconds(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    client = DaemonClient(str(tmp_path / "none.sock"))
    client.state = client.UP  # as if it had answered before
    with caplog.at_level(logging.WARNING, "shmloader"):
        client._go_down("gone")
    client.close()
    (said,) = (r.getMessage() for r in caplog.records if "lost shmloaderd" in r.getMessage())
    assert re.search(r"trying again in [1-9][0-9]* s\b", said), said
