"""Adapters for the training stacks people use: DCP (``dcp``), accelerate, torchtitan.

Each is a small object over a :class:`~shmloader.ShmLoader` that puts every
rank's own state where the framework keeps one copy per key (NOTE [per-rank
state in frameworks] in ``shmloader.integrations.dcp``). Importing this package
imports no framework; ``torchtitan`` imports torchtitan, whose base class it extends.
"""
