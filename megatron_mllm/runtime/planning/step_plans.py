"""optimus-adaptive at run time: each step's schedule planned one step ahead, off the step's
path, for the encoder load the step really has.

While step t runs, a background thread plans step t+1 from its micro-batches' encoder loads
(image counts, or a native tower's nominal images by patches; read one step ahead,
`StepData.prefetch`); the process's first step (0, or the first after a
resume) is planned before it runs, so a resumed run plans as the uninterrupted one did. At
step t+1 every rank asks whether its plan is ready; one tiny all-reduce on a CPU (gloo) group
makes the answer the same everywhere, so all ranks run the planned schedule or all fall back
to the static one (counted). A plan only reorders the replica's micro-batches into 1F1B slots
and re-places encoder work: every micro-batch's loss is unchanged and the reduced gradient is
their sum in another order.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_mllm.runtime.inputs.batches import encoder_load
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
    """Plans step t+1 in a background thread while step t runs (see the module docstring), or
    with `in_step` when asked, on the caller's thread."""

    def __init__(self, planner: AdaptivePlanner, group, in_step: bool = False) -> None:
        self.planner, self.group = planner, group  # group: every rank, on gloo
        self.in_step = in_step  # plan when requested, on the caller's thread (no thread)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-plan")
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.stats = PlanStats()

    def request(self, step: int, counts: list[float]) -> None:
        """Start planning `step` for its micro-batches' encoder loads (`inputs.batches.
        encoder_load`, slot order as loaded)."""
        if not self.in_step:
            self._pending[step] = self._pool.submit(self.planner.plan, counts)
            return
        done = self._pending[step] = concurrent.futures.Future()
        try:
            done.set_result(self.planner.plan(counts))
        except Exception as e:  # as a failed background plan: the static schedule runs
            done.set_exception(e)

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
        failed = future is not None and future.done() and future.exception() is not None
        if failed:  # a failed plan must not stop training: the static schedule runs
            self.stats.failures.append(f"step {step}: {future.exception()}")
        ok = future is not None and future.done() and not failed
        ready = torch.tensor([int(ok)])
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=self.group)
        if future is None:
            return None
        if not ready.item():
            self.stats.fallbacks += 1
            future.cancel()
            return None
        self.stats.planned += 1
        return future.result()

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


class AdaptiveSteps:
    """optimus-adaptive inside one ExecutorRun: each step's program from its own plan (or the
    static one), the next step planned in the background. Creating it is collective."""

    def __init__(self, run) -> None:
        from megatron_mllm.runtime.planning.schedules import adaptive_planner

        self.run, job = run, run.job
        group = dist.new_group(backend="gloo")  # every rank, the plans' agreement
        planner = adaptive_planner(job)
        # None where the schedule keeps the encoder on stage 0: nothing to re-plan
        in_step = job.executor.plan_in_step
        self.planner = None if planner is None else StepPlanner(planner, group, in_step)
        self.orders: list[list[int] | None] = []  # per step: slot -> micro-batch, if planned
        self._enc_counts = None  # the encoder pipelines' micro-batches DDP's counts are for
        self._built: tuple = (None, None, None)  # the last plan's schedule, program, orders

    def program(self, step: int, data):
        """This step's program, metadata, receive orders and slot order (None: as loaded);
        the next step's plan started in the background. `data(m, dp)`: its micro-batches."""
        run, job = self.run, self.run.job
        schedule, program, ordered, order = job.schedule, run.program, run.ordered, None
        plan = self._plan(step, data) if self.planner is not None else None
        if plan is not None:
            built = self._build(plan.schedule)
            if built is not None:
                (schedule, program, ordered), order = built, slot_order(plan)
            else:
                self.planner.stats.fallbacks += 1
        counts = encoder_counts(schedule)
        if counts != self._enc_counts:  # DDP learns its counts again
            if self._enc_counts is not None:
                for sync in run.grad_sync.values():
                    sync.relearn()
            self._enc_counts = counts
        self.orders.append(order)
        return program, schedule.meta, ordered, order

    def _build(self, schedule) -> tuple | None:
        """`schedule`'s program and receive orders (the last plan's again on a cache hit);
        None where ordered p2p would need a message pair no group serves."""
        if self._built[0] is not schedule:
            from megatron_mllm.runtime.engine.program import gpu_program

            ordered = self._orders(schedule)
            if ordered is False:
                return None
            run = self.run
            self._built = (schedule, gpu_program(schedule, run.groups, run.enc_tp), ordered)
        return self._built

    def _plan(self, step: int, data) -> StepPlan | None:
        """`step`'s plan where every rank has it; the next one requested."""
        planner, run, n = self.planner, self.run, self.run.job.num_microbatches
        if not planner.requested(step):  # the first step: nothing planned it ahead
            dp, cfg, times = run.groups.coords.dp, run.job.cfg, run.job.executor.plan_times
            planner.request(step, [encoder_load(data(m, dp), cfg, times) for m in range(n)])
            planner.wait(step)
        plan = planner.take(step)
        planner.request(step + 1, run.data.prefetch(step + 1)[0])
        return plan

    def _orders(self, schedule):
        """Receive orders for `schedule` on the existing message groups (ordered p2p); None
        without ordered p2p; False where it needs a pair no group serves."""
        run = self.run
        if run.ordered is None:
            return None
        from megatron_mllm.runtime.engine.program import all_programs, message_pairs, receive_orders
        from megatron_mllm.runtime.job import encoder_plan_of

        plan = run.job.backbone
        enc_plan, _ = encoder_plan_of(schedule, plan)
        main = all_programs(schedule, plan, enc_plan, run.enc_tp)
        groups = run.ordered[1]
        if not set(message_pairs(main, {})) <= set(groups):
            return False
        return receive_orders(main, run.rank), groups

    def result(self) -> dict:
        planner = self.planner
        return {
            "step_plans": None if planner is None else planner.stats,
            "step_orders": self.orders,
            "step_plan_seconds": [] if planner is None else list(planner.planner.seconds),
        }

    def close(self) -> str | None:
        """Stop the planning thread; the log line of what it did (None if it never ran)."""
        if self.planner is None:
            return None
        self.planner.close()
        return self.planner.stats.line(self.planner.planner.seconds)
