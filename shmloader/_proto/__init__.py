"""The wire layer, pure (no I/O): the batch codec, message frames and kinds,
wait histograms.
"""
