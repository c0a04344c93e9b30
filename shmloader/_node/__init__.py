"""The node layer: shared-memory segments, the ring, releases, ring
directories, the node inventory and the reaping rule (no torch).
"""
