"""What a run is built from: rank processes and their process groups, the rank's model, megatron-
core DDP and optimizer, memory accounting.
"""
