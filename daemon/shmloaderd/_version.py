"""The daemon's version (kept apart so it imports without the package ``__init__``)."""

__version__ = "0.1.0"
