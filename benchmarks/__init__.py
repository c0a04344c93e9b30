"""Benchmarks of shmloader: the same workload loaded three ways.

``python -m benchmarks.run [--quick] [--out DIR]`` runs every configuration in
freshly spawned ranks (gloo on loopback, one node) and writes
``results.json``, ``results.md`` and ``delivery.png``. See
``benchmarks/README.md`` for what each number means. ``python -m
benchmarks.step [--quick]`` measures the training step instead: how long it
waits in ``next()``, per way and rank.
"""
