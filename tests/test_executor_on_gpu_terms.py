"""The executor on a GPU's terms, checked on gloo: lazy ordered receives within a look-ahead,
fills paced by their planned budget and on their own scratch buffer, sent tensors released from
the table, and dynamic run-ahead capped (never beyond the plan's own peak of encoder
activations)."""

import warnings
from dataclasses import replace

import pytest

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
    encoder_plan_of,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.modes.runs import run_rank
from megatron_mllm.runtime.planning.schedules import runtime_schedule
from megatron_mllm.schedule.actions import EF

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
N = 4  # micro-batches
PP2 = ParallelPlan(1, 1, 2)


@pytest.fixture(scope="module")
def state():
    return spawn(make_full_state, 1, TINY, 0)[0]


# -- helpers run inside the spawned ranks ------------------------------------------------------
def _probe(rank, world, job, settings, watch_scratch=False):
    """`run_rank`, with every Executor given `settings` (attributes) before its step and its
    StepResults returned as result["steps"]; optionally with the scratch-buffer sentinel."""
    from megatron_mllm.runtime.engine import executor as ex

    steps, original = [], ex.Executor.run_step

    def run_step(self):
        for name, value in settings.items():
            setattr(self, name, value)
        steps.append(original(self))
        return steps[-1]

    ex.Executor.run_step = run_step
    seen = _watch_scratch() if watch_scratch else None
    out = run_rank(rank, world, job)
    out["steps"] = steps
    if seen is not None:
        out["scratch"] = dict(seen)
    return out


def _watch_scratch() -> dict:
    """Counts get_tensor calls on megatron-core's GlobalMemoryBuffers while a fill runs inside
    a backbone TP collective, and how many of them hit the buffer that was the global one when
    that collective's wait began (the buffer its in-flight output may live in)."""
    import megatron_mllm_patches.async_tp_collectives as tp
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_mllm.runtime.engine import executor as ex

    seen = {"calls": 0, "on_collective_buffer": 0}
    now = {"owner": None, "fill": 0}
    wait, run, get = tp.wait_filling, ex.Executor._run, GlobalMemoryBuffer.get_tensor

    def wait_filling(work, kind):
        outer, now["owner"] = now["owner"], parallel_state._GLOBAL_MEMORY_BUFFER
        try:
            return wait(work, kind)
        finally:
            now["owner"] = outer

    def _run(self, action):
        fill = now["owner"] is not None and action.kind in ("EF", "EB")
        now["fill"] += fill
        try:
            return run(self, action)
        finally:
            now["fill"] -= fill

    def get_tensor(self, *args, **kwargs):
        if now["fill"]:
            seen["calls"] += 1
            seen["on_collective_buffer"] += self is now["owner"]
        return get(self, *args, **kwargs)

    tp.wait_filling, ex.Executor._run, GlobalMemoryBuffer.get_tensor = (
        wait_filling,
        _run,
        get_tensor,
    )
    return seen


def _programs(schedule, plan):
    from megatron_mllm.runtime.engine.program import all_programs

    enc_plan, stage0 = encoder_plan_of(schedule, plan)
    return all_programs(schedule, plan, plan if stage0 else enc_plan, enc_plan.tp)


# -- 5: receives posted ahead, within the look-ahead ------------------------------------------
@pytest.mark.parametrize(
    "ordered, ahead",
    [(True, None), (False, None), (False, 2), (False, 0)],
    ids=["ordered", "tagged", "tagged-2", "tagged-0"],
)
def test_receives_are_posted_lazily_within_the_lookahead(state, ordered, ahead):
    """NCCL matches by order and a posted receive spins until its data arrives: each sender's
    receives are posted when needed plus at most `RECV_LOOKAHEAD`, never all at step start.
    Tagged (gloo) by default: every receive of the program goes up with the first (all of a
    sender's out at once); with a look-ahead of 2, the next two with the one needed (at least
    two out at once, never more than three: the program has more messages per sender than
    that); with 0, each posted alone, when needed."""
    from megatron_mllm.runtime.engine.messages import RECV_LOOKAHEAD
    from megatron_mllm.runtime.engine.program import receive_orders

    schedule = runtime_schedule(TINY, PP2, 1, N, "optimus")
    programs = _programs(schedule, PP2)
    per_sender = {r: receive_orders(programs, r) for r in programs}
    bound = (RECV_LOOKAHEAD if ahead is None else ahead) + 1
    assert all(len(keys) > bound for orders in per_sender.values() for keys in orders.values())
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(PP2, schedule=schedule),
        DataParts(1, N),
        executor=ExecutorSettings(ordered_p2p=ordered, recv_lookahead=ahead),
    )
    outs = spawn(_probe, 2, job, {})
    for rank, out in enumerate(outs):
        (step,) = out["steps"]
        assert set(step.max_posted_ahead) == set(per_sender[rank])
        if not ordered and ahead is None:  # every receive from a sender out at once
            whole = {src: len(keys) for src, keys in per_sender[rank].items()}
            assert step.max_posted_ahead == whole
        else:
            least = 1 if ordered or not ahead else 2
            most = step.max_posted_ahead.values()
            assert all(least <= n <= bound for n in most), step.max_posted_ahead
        # Times are StepClock marks read at step end: every span lies inside the step.
        assert step.seconds > 0
        assert all(0 <= s.start <= s.end <= step.seconds + 1e-6 for s in step.spans)
    assert set(outs[1]["steps"][0].losses) == set(range(N))
    assert all(isinstance(v, float) for v in outs[1]["steps"][0].losses.values())


def _use_schedule_twice(rank, world, job):
    """Builds the run, switches to its own schedule twice (what a re-plan does), counts the
    process groups created meanwhile, then takes a step on the reused groups."""
    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    device = init_rank(rank, world, job.data.seed, job.timeout_s)
    run = ExecutorRun(rank, world, job, device)
    before, created, new_group = dict(run.pair_groups), [], dist.new_group
    dist.new_group = lambda *a, **k: created.append(a) or new_group(*a, **k)
    try:
        run.use_schedule(job.schedule)
        run.use_schedule(job.schedule)
    finally:
        dist.new_group = new_group
    run.step(0)
    same = all(run.pair_groups[p] is g for p, g in before.items())
    out = {"pairs": sorted(before), "created": len(created), "same": same, "loss": run.last_loss}
    dist.destroy_process_group()
    return out


def test_a_replan_reuses_the_message_pairs_groups(state):
    """Ordered messages use one group per (sender, receiver) pair; switching schedules (each
    re-plan) keeps those groups instead of creating new communicators every time."""
    schedule = runtime_schedule(TINY, PP2, 1, N, "optimus")
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(PP2, schedule=schedule),
        DataParts(1, N),
        executor=ExecutorSettings(ordered_p2p=True),
    )
    outs = spawn(_use_schedule_twice, 2, job)
    for out in outs:
        assert out["pairs"] == [(0, 1), (1, 0)], out
        assert out["created"] == 0 and out["same"], out
    assert outs[0]["loss"] == outs[1]["loss"]


def _batches_seen_by_actions(rank, world, job):
    """`run_rank`, recording at every action which micro-batches the executor holds."""
    from megatron_mllm.runtime.engine import executor as ex

    seen, run = [], ex.Executor._run

    def _run(self, action):
        seen.append(tuple(sorted(self._batches)))
        return run(self, action)

    ex.Executor._run = _run
    out = run_rank(rank, world, job)
    out["seen"] = seen
    return out


def test_every_batch_is_on_the_device_before_the_first_action(state):
    """Batches move at the step's start (pinned and non-blocking on a GPU), never mid-step
    where a copy from pageable memory would stall the queued kernels: every action of the
    step sees the same held micro-batches, all of the step's."""
    schedule = runtime_schedule(TINY, PP2, 1, N, "optimus")
    job = RuntimeJob(ModelParts(TINY, state), PlanParts(PP2, schedule=schedule), DataParts(1, N))
    for out in spawn(_batches_seen_by_actions, 2, job):
        assert out["seen"] and set(out["seen"]) == {tuple(range(N))}, set(out["seen"])


# -- 6: the fills' scratch buffer --------------------------------------------------------------
def test_fills_never_touch_the_scratch_buffer_of_an_in_flight_collective(state):
    """With sequence parallelism the backbone's in-flight all-gather writes into megatron-core's
    global "mpu" buffer, and the encoder's attention asks that same buffer for its scores: a
    fill inside the collective must get its tensors from a buffer of its own."""
    plan = ParallelPlan(1, 2, 1)
    schedule = runtime_schedule(TINY, plan, 1, N, "optimus", unit="kernel")
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(plan, schedule=schedule, encoder_units="kernel", sequence_parallel=True),
        DataParts(1, N),
        executor=ExecutorSettings(overlap_tp_fills=True),
    )
    outs = spawn(_probe, 2, job, {}, True)
    assert sum(o["overlapped"] for o in outs) > 0
    seen = {k: sum(o["scratch"][k] for o in outs) for k in ("calls", "on_collective_buffer")}
    assert seen["calls"] > 0, "fills never asked for scratch memory: the sentinel sees nothing"
    assert seen["on_collective_buffer"] == 0, seen


def _reductions_started(rank, world, job):
    """`run_rank`, counting encoder-bucket reductions started inside a backbone TP wait (which
    runs fills) and outside one."""
    import megatron_mllm_patches.async_tp_collectives as tp
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    counts, depth = {"inside": 0, "outside": 0}, [0]
    wait, start = tp.wait_filling, G.start_grad_sync

    def wait_filling(work, kind):
        depth[0] += 1
        try:
            return wait(work, kind)
        finally:
            depth[0] -= 1

    def start_grad_sync(self, *args, **kwargs):
        counts["inside" if depth[0] else "outside"] += 1
        return start(self, *args, **kwargs)

    tp.wait_filling, G.start_grad_sync = wait_filling, start_grad_sync
    out = run_rank(rank, world, job)
    out["reductions"] = counts
    return out


def test_no_gradient_reduction_starts_inside_a_backbone_tp_wait(state):
    """Encoder backward fills inside the backbone's TP collectives with overlapped gradient
    reduction: a bucket made ready by a fill starts its reduction after the collective, never
    inside its wait (on NCCL the ranks would order the two communicators' calls differently)."""
    plan = ParallelPlan(1, 2, 1)
    schedule = runtime_schedule(TINY, plan, 1, N, "optimus", unit="kernel")
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(plan, schedule=schedule, encoder_units="kernel"),
        DataParts(1, N),
        steps=2,  # the first step learns the buckets' counts; the second starts them in hooks
        optimizer=OptimizerSettings(overlap_grad_reduce=True),
        executor=ExecutorSettings(overlap_tp_fills=True),
    )
    outs = spawn(_reductions_started, 2, job)
    assert sum(o["overlapped"] for o in outs) > 0
    assert all(o["reductions"]["inside"] == 0 for o in outs), [o["reductions"] for o in outs]
    assert sum(o["reductions"]["outside"] for o in outs) > 0


# -- 7: fill pacing ----------------------------------------------------------------------------
class _NeverDone:
    """A collective the host never sees complete (a GPU's host runs far ahead of it)."""

    waited = 0

    def is_completed(self):
        return False

    def wait(self, *args):
        _NeverDone.waited += 1
        return True


def test_fill_budgets_follow_the_planned_bubbles():
    from megatron_mllm.runtime.engine.fill_pacing import fill_budgets

    fills = tuple(EF(0, 0, 0, 0, k, k + 1, fill=k) for k in range(5))
    assert fill_budgets(fills, 9, 9) == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert fill_budgets(fills, 3, 9) == [3, 2, 0]
    assert fill_budgets(fills, 18, 9)[::2] == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert fill_budgets(fills, 0, 9) == []  # no collective: every fill runs after the action


def test_a_collective_never_seen_complete_runs_only_its_budget():
    """Through the patch's own wait path: a wait whose work never reports completed runs its
    planned budget of fills and no more (the rest wait for later collectives or the action's
    end), on a scratch buffer of the fills' own."""
    import megatron_mllm_patches.async_tp_collectives as tp
    from megatron.core import parallel_state

    from megatron_mllm.runtime.engine.fill_pacing import FillPacer

    ran, buffers = [], []

    def run(action, kind):
        ran.append((action.k0, kind))
        buffers.append(parallel_state._GLOBAL_MEMORY_BUFFER)

    fills = tuple(EF(0, 0, 0, 0, k, k + 1, fill=k) for k in range(6))
    pacer = FillPacer(fills, [2, 0, 1], run)
    waited = _NeverDone.waited
    backbone_buffer = object()
    previous, parallel_state._GLOBAL_MEMORY_BUFFER = (
        parallel_state._GLOBAL_MEMORY_BUFFER,
        backbone_buffer,
    )
    try:
        with tp.filling(pacer):
            for kind in ("all_gather", "reduce_scatter", "all_gather", "all_reduce"):
                tp.wait_filling(_NeverDone(), kind)
        assert parallel_state._GLOBAL_MEMORY_BUFFER is backbone_buffer  # restored
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = previous
    assert pacer.ran == [2, 0, 1, 0]
    assert ran == [(0, "all_gather"), (1, "all_gather"), (2, "all_gather")]
    assert [a.k0 for a in pacer.queue] == [3, 4, 5]
    assert buffers and all(b is not backbone_buffer for b in buffers)
    assert _NeverDone.waited - waited == 4


def test_wait_observer_gets_marks_taken_around_the_wait():
    """The collective observer is told marks from the clock it is given (StepClock's on a GPU:
    CUDA events bracketing the stall), not host seconds."""
    import megatron_mllm_patches.async_tp_collectives as tp

    ticks, told = iter(range(100)), []
    with tp.observing(lambda *a: told.append(a), mark=lambda: next(ticks)):
        tp.wait_filling(_NeverDone(), "all_reduce")
    assert told == [("all_reduce", 0, 1, False)]


# -- 9: memory ---------------------------------------------------------------------------------
def test_sent_tensors_leave_the_table_and_dynamic_run_ahead_is_capped(state):
    """Dynamic mode on PP=2 with encoder DP=2: the table holds no tensor after the step (a sent
    one leaves it once its send is posted), and run-ahead never holds more than
    `max_encoder_ahead` encoder micro-batches ahead of the program, while a loose cap lets it
    run further (so the cap is what bounds it)."""
    plan, forced = PP2, ParallelPlan(2, 1, 1)
    schedule = runtime_schedule(TINY, plan, 1, N, "optimus", encoder_plan=forced)
    sent = {op.key for p in _programs(schedule, plan).values() for op in p if op.kind == "send"}
    assert sent
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(plan, schedule=schedule),
        DataParts(1, N),
        executor=ExecutorSettings(dynamic=True),
        steps=2,
    )
    loose = spawn(_probe, 2, job, {"max_encoder_ahead": N})
    capped = spawn(_probe, 2, job, {"max_encoder_ahead": 1})
    for outs in (loose, capped):
        for out in outs:
            for step in out["steps"]:
                assert not set(step.leftover_keys) & sent
                assert step.leftover_keys == []
    assert max(s.max_encoder_ahead for o in loose for s in o["steps"]) > 1
    assert max(s.max_encoder_ahead for o in capped for s in o["steps"]) == 1
    assert sum(o["moved"] for o in capped) > 0
    # Whatever the cap, never more encoder activations held than the plan holds at its peak
    # (the order the planner estimated memory for).
    # The static program reaches exactly the peak counted from it (so the count is right).
    static = spawn(_probe, 2, replace(job, executor=ExecutorSettings()), {})
    for out in static:
        assert all(s.max_encoder_live == s.planned_encoder_live for s in out["steps"])
    for out in (*loose, *capped):
        for step in out["steps"]:
            assert 1 <= step.max_encoder_live <= step.planned_encoder_live
    # Same losses either way: the cap changes only when work runs.
    for a, b in zip(loose, capped, strict=True):
        for x, y in zip(a["history"], b["history"], strict=True):
            assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], abs=1e-6) for k in x)
