"""``python -m shmloader``: the ``shmloader`` command (``shmloader.tools.cli``); owns nothing."""

import sys

from .tools.cli import main

sys.exit(main())
