"""The daemon's version: the package's (one place, ``shmloader.__version__``)."""

from shmloader import __version__

__all__ = ["__version__"]
