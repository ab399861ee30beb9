"""Schedules for the runtime's model: planned, planned per step, re-planned from measured times,
and the profiling that measures them.
"""
