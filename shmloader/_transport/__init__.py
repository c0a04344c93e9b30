"""Transports that carry the codec's output: ZeroMQ on a node, the gloo link
across nodes, the daemon's client.
"""
