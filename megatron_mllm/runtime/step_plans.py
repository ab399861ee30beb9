"""optimus-adaptive at run time: each step's schedule planned one step ahead, off the step's
path, for the encoder load the step really has.

While step t runs, a background thread plans step t+1 from its micro-batches' image counts
(read one step ahead; `StepData.prefetch`); the process's first step (0, or the first after a
resume) is planned before it runs, so a resumed run plans as the uninterrupted one did. At
step t+1 every rank asks whether its plan is ready; one tiny all-reduce on a CPU (gloo) group
makes the answer the same everywhere, so all ranks run the planned schedule or all fall back
to the static one (counted). A plan only
reorders the replica's micro-batches into 1F1B slots and re-places encoder work: every
micro-batch's loss is unchanged and the reduced gradient is their sum in another order.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_mllm.schedule.adaptive import AdaptivePlanner, StepPlan


@dataclass
class PlanStats:
    """What the log line and the run's result report."""

    planned: int = 0  # steps that ran their own plan
    fallbacks: int = 0  # steps whose plan was not ready in time (or failed): the static one ran
    failures: list[str] = field(default_factory=list)

    def line(self, seconds: list[float]) -> str:
        mean = 1000 * sum(seconds) / len(seconds) if seconds else 0.0
        return (
            f"step plans: {self.planned} planned, {self.fallbacks} static fallback(s), "
            f"{mean:.1f} ms CPU each"
        )


class StepPlanner:
    """Plans step t+1 in a background thread while step t runs (see the module docstring)."""

    def __init__(self, planner: AdaptivePlanner, group) -> None:
        self.planner, self.group = planner, group  # group: every rank, on gloo
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-plan")
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.stats = PlanStats()

    def request(self, step: int, counts: list[int]) -> None:
        """Start planning `step` for its micro-batches' image counts (slot order as loaded)."""
        self._pending[step] = self._pool.submit(self.planner.plan, counts)

    def requested(self, step: int) -> bool:
        return step in self._pending

    def wait(self, step: int) -> None:
        """Until `step`'s plan is made (or has failed): the process's first step, which no
        earlier step planned ahead."""
        concurrent.futures.wait([self._pending[step]])

    def take(self, step: int) -> StepPlan | None:
        """The plan for `step` if every rank has it now, else None (the static schedule runs).
        Collective: every rank calls it once per step."""
        future = self._pending.pop(step, None)
        ready = torch.tensor([int(future is not None and future.done())])
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=self.group)
        if future is None:
            return None
        if not ready.item():
            self.stats.fallbacks += 1
            future.cancel()
            return None
        try:
            plan = future.result()
        except Exception as err:  # noqa: BLE001 - a failed plan must not stop training
            self.stats.failures.append(f"step {step}: {err}")
            plan = None
        ok = torch.tensor([int(plan is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not ok.item():
            self.stats.fallbacks += 1
            return None
        self.stats.planned += 1
        return plan

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def slot_order(plan: StepPlan) -> list[int]:
    """slot -> the replica's micro-batch (as loaded) that trains in it."""
    return [mb[0] for mb in plan.assignment[0]]


def encoder_counts(schedule) -> list[tuple[int, int]]:
    """(encoder, pipeline) -> micro-batches it runs: DDP's per-parameter gradient counts
    follow these, so a plan that changes them makes DDP learn its counts again."""
    counts: dict[tuple[int, int], int] = {}
    for e, assignment in enumerate(schedule.encoder_assignment()):
        for pipe in assignment.values():
            counts[(e, pipe)] = counts.get((e, pipe), 0) + 1
    return sorted(counts.items())
