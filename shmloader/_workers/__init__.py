"""What runs in the leader's DataLoader workers: the slot pool and the collate
that writes into it.
"""
