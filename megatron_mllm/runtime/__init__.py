"""The runtime: real training steps of a planned schedule on real process groups.

* `job.py`: the RuntimeJob, everything a run is (model, plans, data, settings), checked once.
* `engine/`: a rank's program and the Executor that interprets it, one step at a time.
* `assembly/`: rank processes, process groups, the rank's model, DDP and optimizer.
* `modes/`: the training run on our executor, megatron-core's own schedule, the reference.
* `planning/`: the schedules runs execute, planned, planned per step and re-planned.
* `inputs/`: each step's micro-batches.
"""
