"""The ``shmloader`` command: ``demo``, ``stat``, ``gc`` and ``daemon``.

It owns the argument parser and hands each subcommand to its module (``stat``
and ``gc`` to ``shmloader.tools.stat``, ``demo`` to ``shmloader.tools.demo``,
``daemon`` to ``shmloaderd``); human output by default, ``stat --json`` for
scripts. Training code never imports it.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from . import demo
    from . import stat as stat_cli

    parser = argparse.ArgumentParser(
        prog="shmloader",
        description="One DataLoader per sequence-parallel group, batches shared once per node.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    parser.add_argument("--version", action="version", version=f"shmloader {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a local multi-rank job and report what sharing saves")
    demo.add_arguments(p)
    p.set_defaults(func=_demo)

    stat_cli.register(sub)

    # listed for --help; main() hands "daemon ..." to shmloaderd before parsing
    sub.add_parser("daemon", help="run the node daemon (same as shmloaderd; see daemon --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["daemon"]:  # everything after it, --help included, is shmloaderd's
        from shmloaderd.__main__ import main as daemon_main

        return daemon_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
