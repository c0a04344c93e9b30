"""Command-line tools: ``shmloader stat``, ``gc`` and ``demo``; never imported
by training code.
"""
