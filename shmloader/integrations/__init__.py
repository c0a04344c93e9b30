"""Adapters for the stacks people train with: ``dcp``, ``accelerate``, ``torchtitan``, Lightning.

Each is a small object over a :class:`~shmloader.ShmLoader` that puts every
rank's own state where the framework keeps one copy per key (NOTE [per-rank
state in frameworks] in ``shmloader.integrations.dcp``). Importing this package
imports no framework, nor do its modules (``lightning`` too) but ``torchtitan``, whose
``BaseDataLoader`` its adapter extends.
"""
