"""Adapters for the stacks people train with: ``dcp``, ``accelerate``, ``torchtitan``, Lightning.

Each is a small object over a :class:`~shmloader.ShmLoader` that puts every
rank's own state where the framework keeps one copy per key (NOTE [per-rank
state in frameworks] in ``shmloader.integrations.dcp``). Importing this package
imports no framework, and no module of it does but ``torchtitan``, whose
``BaseDataLoader`` its adapter extends.
"""
