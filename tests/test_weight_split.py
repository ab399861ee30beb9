"""The encoder's backward split into input-gradient (EB) and weight-gradient (EW) work: the
kernels add up to the unsplit backward, the IR carries EW through validator and simulator,
weight gradients go into later bubbles, and the planner keeps the split only where it pays."""

from dataclasses import replace

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import BENCH
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.planning.schedules import job_of
from megatron_mllm.schedule.actions import parse_action
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
from megatron_mllm.schedule.dataflow import Dataflow
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.planner import plan_optimus
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, validate

N = 6


@pytest.fixture(scope="module", params=["kernel", "layer"])
def split(request):
    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit=request.param)
    opts = OptimusOptions(ParallelPlan(1, 1, 2), split="even")
    plain = optimus_schedule(costs, opts)
    return plain, optimus_schedule(costs, replace(opts, wgrad_split=True))


def test_the_split_adds_up_to_the_backward(split):
    (_, plain), (schedule, wl) = split
    for e, enc in enumerate(schedule.meta.encoders):
        assert enc.wgt_kernels and all(n > 0 for n in enc.wgt_kernels)
        for s in range(enc.num_stages):
            whole = sum(k.compute_s for k in plain.encoder_bwd[e][s])
            parts = sum(k.compute_s for k in wl.encoder_bwd[e][s] + wl.encoder_wgt[e][s])
            assert parts == pytest.approx(whole)
            assert sum(k.comm_s for k in wl.encoder_wgt[e][s]) == 0  # comms stay with dX
            assert 0.3 < sum(k.compute_s for k in wl.encoder_wgt[e][s]) / whole < 0.5


def test_a_split_schedule_validates_simulates_and_round_trips(split):
    (plain_schedule, plain), (schedule, wl) = split
    validate(schedule)
    assert any(a.kind == "EW" for acts in schedule.ranks for a in acts)
    again = Schedule.from_csv(schedule.to_csv())
    assert again.meta == schedule.meta and again.ranks == schedule.ranks
    validate(again)
    ew = next(a for acts in schedule.ranks for a in acts if a.kind == "EW")
    assert parse_action(str(ew)) == ew and str(ew).startswith("EW:e0p")
    flow = Dataflow(schedule.meta, schedule.encoder_assignment())
    enc = schedule.meta.encoders[0]
    total = enc.bwd_kernels[ew.stage]
    assert str(TensorKey.ebk(0, ew.stage, ew.mb, total)) in flow.needs(ew)
    sim, base = simulate(schedule, wl), simulate(plain_schedule, plain)
    assert sim.limit_s == pytest.approx(base.limit_s)  # the same work in all


def test_weight_gradients_must_follow_their_input_gradient(split):
    _, (schedule, _) = split
    ranks = [list(acts) for acts in schedule.ranks]
    for acts in ranks:
        i = next((i for i, a in enumerate(acts) if a.kind == "EW"), None)
        if i is None:
            continue
        ew = acts.pop(i)
        j = next(j for j, a in enumerate(acts) if a.kind == "EB" and a.mb == ew.mb
                 and a.stage == ew.stage)  # fmt: skip
        acts.insert(j, ew)  # before its own input gradient
        with pytest.raises(ScheduleError, match=r"at EW:.*\[order\] .*ebk"):
            validate(Schedule(schedule.meta, ranks))
        return
    pytest.fail("no EW action")


def test_the_planner_keeps_the_split_only_where_it_pays():
    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit="kernel")
    base, _, _ = plan_optimus(costs)
    best, candidates, _ = plan_optimus(costs, wgrad_split=True)
    assert best.result.step_time_s <= base.result.step_time_s
    assert base.options.placement == "colocated"  # this job's plan: the split is tried on it
    split = [t for o, t, _ in candidates if o.wgrad_split]
    assert len(split) == 1
    assert best.options.wgrad_split == (split[0] < base.result.step_time_s)
    assert best.result.step_time_s == pytest.approx(min(split[0], base.result.step_time_s))


def test_the_executor_refuses_a_split_schedule(split):
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob, check_job

    _, (schedule, _) = split
    job = RuntimeJob(
        ModelParts(BENCH, {}), PlanParts(ParallelPlan(1, 1, 2), schedule=schedule),
        DataParts(2, N),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="splits the encoder's backward"):
        check_job(job, 2)
