"""The roles behind ``ShmLoader``: the leader, node leader, follower
and local rank, their shared contract and state.
"""
