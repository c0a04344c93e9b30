"""Set-up: the topology exchange, the arrival of ranks, the epoch length and
the role a rank gets.
"""
