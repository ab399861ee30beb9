"""Run modes over the engine: our executor's training run, megatron-core's own schedule, the one-
process reference, and running several in one job.
"""
