"""The runtime's run modes behind one protocol, and the entry points that drive them.

Modes (`RuntimeJob.mode`):
* "executor": our executor runs `job.schedule` (any validated schedule of the MLLM);
* "megatron_core": megatron-core's own 1F1B with the encoder in stage 0's forward step (the
  baseline users have today);
* "reference": one process, no parallelism, every micro-batch in turn.
All load the same canonical weights (`job.model.weights`), so losses and gradients can be compared.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_mllm.runtime.assembly.bootstrap import init_rank
from megatron_mllm.runtime.job import RuntimeJob, check_job


class Run(Protocol):
    """What every run mode offers: built once, then stepped."""

    def step(self, step: int) -> None: ...

    def replan(self) -> bool: ...

    def result(self) -> dict: ...


def make_run(rank: int, world: int, job: RuntimeJob, device: torch.device) -> Run:
    """The built run of `job.mode` on this rank (after `init_rank`)."""
    if job.mode == "megatron_core":
        from megatron_mllm.runtime.modes.megatron_baseline import MegatronCoreRun

        return MegatronCoreRun(rank, job, device)
    if job.mode == "reference":
        from megatron_mllm.runtime.modes.reference import ReferenceRun

        return ReferenceRun(job, device)
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    return ExecutorRun(rank, world, job, device)


def run_rank(rank: int, world: int, job: RuntimeJob) -> dict:
    """Entry point of one rank (see `launch.spawn`): `job.steps` steps, then the result."""
    return run_interleaved(rank, world, [job], job.steps)[0]


def turn_order(runs: int, step: int) -> list[int]:
    """The runs' order in `step`'s turn: 0 .. runs - 1 rotated left by `step`."""
    return [(step + i) % runs for i in range(runs)]


def run_interleaved(
    rank: int,
    world: int,
    jobs: list[RuntimeJob],
    steps: int,
    makers: list | None = None,
    lead: list[int] | None = None,
) -> list[dict]:
    """Several jobs in the same processes, taking steps in turn, the turn's order rotated by
    one each step (A B C, B C A, C A B, ...): the fairest comparison on a noisy machine, with
    no run always following the same one (a run's step can leave the next one slower: freed
    memory faulted in again). Returns each job's result. `makers`: per job, what builds its
    run from (rank, world, job, device), None for `make_run`; `lead`: per job, steps it takes
    before the runs without a lead start (runs with one take theirs in turn; their later
    steps are interleaved with everyone's)."""
    for job in jobs:
        check_job(job, world)
    device = init_rank(rank, world, jobs[0].data.seed, jobs[0].timeout_s)
    makers = makers or [None] * len(jobs)
    runs = [(m or make_run)(rank, world, job, device) for job, m in zip(jobs, makers, strict=True)]
    lead = lead or [0] * len(jobs)
    for step in range(max(lead)):
        leading = [run for run, extra in zip(runs, lead, strict=True) if step < extra]
        for run in leading:
            if len(leading) > 1:
                dist.barrier()
            run.step(step)
    for step in range(steps):
        for i in turn_order(len(jobs), step):
            job, run, extra = jobs[i], runs[i], lead[i]
            if len(jobs) > 1:  # every rank starts it together, not skewed by the run before
                dist.barrier()
            run.step(step + extra)
            if job.executor.replan_after is not None and step + 1 == job.executor.replan_after:
                run.replan()
    dist.barrier()
    return [run.result() for run in runs]
