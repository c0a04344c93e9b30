"""The roles behind ``ShmLoader``: the leader, node leader (relay), follower
and local rank, their shared contract and state.
"""
