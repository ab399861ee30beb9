"""The step engine: a rank's program of actions and messages, interpreted by the Executor
(messages, fill pacing, clocks, the time breakdown).
"""
