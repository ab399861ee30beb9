"""Data-aware Optimus (`optimus-adaptive`): each step planned for the encoder load it has.

The encoder plan, the backbone and the static plan's options stay fixed for the run (they are
built into the modules). For one step, from its samples' image counts:

1. cost-balanced assignment: samples into micro-batches and micro-batches into DP replicas with
   equal image counts as far as they go (`loads.balanced_assignment`);
2. the bubble scheduler places the micro-batches of the replica with the most images at their
   real loads, for a few slot orders and encoder-pipeline splits;
3. the fastest in simulation is kept. The static schedule, timed on the loader's assignment, is
   a candidate too, so a step's plan is never slower than the static one in simulation.

The simulator times one replica; the step is timed on the one with the most images (all wait
for it at the DP reduction). Balanced plans are cached by the multiset of loads (in steps of
1 / `BUCKETS` of an image): the balanced assignment depends on nothing else, so a repeated
multiset reuses the plan with its samples renamed (the static candidate, which depends on the
loader's order, is timed every step).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import optimus_schedule
from megatron_mllm.schedule.loads import (
    Assignment,
    balanced_assignment,
    heaviest,
    loader_assignment,
    micro_loads,
)
from megatron_mllm.schedule.planner import Planned
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import SimResult, simulate
from megatron_mllm.schedule.validator import validate
from megatron_mllm.schedule.workload import Workload

# Plans are cached by the loads' multiset in steps of 1 / BUCKETS of a costed image: image
# counts are whole; a native tower's loads (nominal images by patches) are not, and would
# never meet again unbucketed.
BUCKETS = 4


@dataclass(frozen=True)
class StepPlan:
    """One step's plan: which samples each replica trains in which 1F1B slot, the schedule
    and its costs for the timed replica's loads (in slot order), and its simulated time."""

    assignment: Assignment  # [replica][slot] -> sample indices of the global batch
    schedule: Schedule
    workload: Workload
    step_time_s: float
    peak_memory_gb: float
    candidate: str  # which candidate won ("static" keeps the static schedule and assignment)


class AdaptivePlanner:
    """Per-step plans around one static Optimus plan (see the module docstring)."""

    def __init__(
        self,
        costs: JobCosts,
        static: Planned,
        costed_images: float = 1.0,
        skip_text_only: bool = True,
        whole_micro_batches: bool = False,
    ) -> None:
        """`costed_images`: images per sample the encoder's costs are for. With
        `whole_micro_batches` (the runtime's mode) the counts given to `plan` are one replica's
        images per micro-batch, and only their 1F1B slots are chosen: no sample moves to
        another micro-batch or replica, so every micro-batch's loss is what it was."""
        job = costs.job
        self.costs, self.static, self.costed = costs, static, costed_images
        self.dp, self.micro_batch = job.plan.dp, job.micro_batch
        if whole_micro_batches:  # a "sample" is then a micro-batch of one replica
            self.dp, self.micro_batch = 1, 1
            self.costed = costed_images * job.micro_batch
        self.skip_text_only = skip_text_only
        self.memory_gb = job.hw.memory_gb
        self._timeline: dict = {}  # the backbone timeline, shared by every step
        self._plans: dict[tuple[int, ...], tuple[list[int], StepPlan]] = {}
        self.hits = self.misses = 0
        self.seconds: list[float] = []  # CPU seconds of each plan() call

    def plan(self, counts: Sequence[int]) -> StepPlan:
        """The plan for one global batch, given each sample's image count in loader order."""
        t0 = time.process_time()
        with _no_cyclic_gc():
            kept = self._plan(list(counts))
        self.seconds.append(time.process_time() - t0)
        return kept

    def _plan(self, counts: list[int]) -> StepPlan:
        static = self.static
        loader = loader_assignment(len(counts), self.dp, self.micro_batch)
        kept = self._timed(counts, loader, static.schedule, static.workload, "static")
        balanced = self._balanced(counts)
        if balanced.step_time_s <= kept.step_time_s:  # a tie: the even replicas, heavy first
            kept = balanced
        return kept

    def _balanced(self, counts: list[int]) -> StepPlan:
        """The best plan on the balanced assignment, cached by the multiset of (bucketed)
        loads."""
        ranked = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
        key = tuple(round(counts[i] * BUCKETS) for i in ranked)
        cached = self._plans.get(key)
        if cached is not None:
            self.hits += 1
            old_ranked, plan = cached
            rename = dict(zip(old_ranked, ranked, strict=True))
            return replace(plan, assignment=_renamed(plan.assignment, rename))
        self.misses += 1
        static = self.static
        balanced = balanced_assignment(counts, self.dp, self.micro_batch)
        desc = balanced[heaviest(counts, balanced)]  # heaviest micro-batch first
        best = None
        for name, slots, split in (
            ("balanced", desc, None),
            ("heavy-first", desc, static.options.split),
            ("light-first", desc[::-1], static.options.split),
        ):
            assignment = _in_slot_order(counts, balanced, slots)
            if split is None:
                schedule, workload = static.schedule, static.workload
            else:
                loads = micro_loads(counts, slots, self.costed)
                opts = replace(static.options, split=split)
                schedule, workload = optimus_schedule(
                    self.costs, opts, self._timeline, loads, self.skip_text_only
                )
            plan = self._timed(counts, assignment, schedule, workload, name)
            if plan.peak_memory_gb > self.memory_gb and name != "balanced":
                continue  # a heavy micro-batch's activations must still fit
            if best is None or plan.step_time_s < best.step_time_s - 1e-12:
                best = plan
        if best.schedule is not static.schedule:
            validate(best.schedule)
        self._plans[key] = (ranked, best)
        return best

    def _timed(
        self,
        counts: list[int],
        assignment: Assignment,
        schedule: Schedule,
        workload: Workload,
        name: str,
    ) -> StepPlan:
        workload, result = timed_step(schedule, workload, counts, assignment, self.costed)
        return StepPlan(
            assignment, schedule, workload, result.step_time_s, result.peak_memory_gb, name
        )


def timed_step(
    schedule: Schedule,
    workload: Workload,
    counts: list[int],
    assignment: Assignment,
    costed_images: float,
) -> tuple[Workload, SimResult]:
    """`schedule` simulated on the loads of the replica with the most images (the one the
    step waits for): that workload and the simulation (idle time not classified)."""
    loads = micro_loads(counts, assignment[heaviest(counts, assignment)], costed_images)
    workload = workload.at_loads(loads)
    return workload, simulate(schedule, workload, keep_spans=False, classify=False)


@contextlib.contextmanager
def _no_cyclic_gc():
    """A plan makes many short-lived objects that reference counting frees; the cyclic
    collector's passes over everything else alive would cost a third of the planning time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _in_slot_order(counts: list[int], assignment: Assignment, slots: list[list[int]]) -> Assignment:
    """Every replica's micro-batches in the slot order `slots` (one replica's) gives: the
    micro-batch of load rank k goes where that replica's load rank k went."""

    def by_load(mbs: list[list[int]]) -> list[int]:
        return sorted(range(len(mbs)), key=lambda m: (-sum(counts[i] for i in mbs[m]), m))

    rank_of_slot = {m: k for k, m in enumerate(by_load(slots))}
    out = []
    for mbs in assignment:
        ranked = by_load(mbs)
        out.append([mbs[ranked[rank_of_slot[s]]] for s in range(len(slots))])
    return out


def _renamed(assignment: Assignment, rename: dict[int, int]) -> Assignment:
    return [[[rename[i] for i in mb] for mb in replica] for replica in assignment]
