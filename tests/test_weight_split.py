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


def test_transformer_engine_layers_refuse_a_split_schedule(split):
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob, check_job

    _, (schedule, _) = split
    job = RuntimeJob(
        ModelParts(BENCH, {}, transformer_impl="transformer_engine"),
        PlanParts(ParallelPlan(1, 1, 2), schedule=schedule), DataParts(2, N),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="split encoder backward.*--transformer-impl local"):
        check_job(job, 2)


@pytest.mark.parametrize(
    "layout",
    ["reversed", pytest.param("first", marks=pytest.mark.slow),
     pytest.param("reversed-recompute", marks=pytest.mark.slow),
     pytest.param("reversed-kernel", marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_executor_runs_a_split_backward_as_the_reference(layout):
    """EB actions give input gradients and keep the linears' weight products, EW actions turn
    them into weight gradients through DDP's hooks (overlapped reduction in small buckets,
    megatron-core's distributed optimizer): three steps give the one-process reference's
    losses, the first step's gradients match, and every EW action ran. With the encoder's
    layers recomputed, their forward runs again inside EB and defers as well."""
    from megatron_mllm.models.config import TINY
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from megatron_mllm.schedule.config import Recompute
    from tests.test_runtime import TRAIN, check_against, check_both_optimizers, reference_of

    plan, n = ParallelPlan(1, 1, 2), 4
    enc_plan = ParallelPlan(1, 1, 2, 1, layout.startswith("reversed"))
    recompute = Recompute(vision=layout.endswith("recompute"))
    state, ref = reference_of(TINY, **dict(TRAIN, steps=3))
    unit = "kernel" if layout.endswith("kernel") else "layer"  # EW kernels: the pieces'
    schedule = runtime_schedule(TINY, plan, 1, n, "optimus", encoder_plan=enc_plan, unit=unit,
                                wgrad_split=True)  # fmt: skip
    assert any(a.kind == "EW" for acts in schedule.ranks for a in acts)
    # megatron-core's DDP reduces each bucket from its hooks as soon as its last gradient is in
    opt = replace(TRAIN["optimizer"], overlap_grad_reduce=True, ddp_bucket_size=20_000)
    job = RuntimeJob(ModelParts(TINY, state, recompute=recompute),
                     PlanParts(plan, schedule, unit), DataParts(1, n), steps=3,
                     optimizer=opt)  # fmt: skip
    outs = spawn(run_rank, plan.world_size, job)
    check_against((state, ref), outs, {"backbone": 1, "encoder": 1, "projector": 1})
    ran = {str(s.action) for o in outs for s in o["spans"] if s.action.kind == "EW"}
    planned = {str(a) for acts in schedule.ranks for a in acts if a.kind == "EW"}
    assert planned and planned <= ran, sorted(planned - ran)[:3]
    check_both_optimizers(ref, job, outs, plan.world_size)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--bubble-schedule", "megatron"], "--bubble-schedule megatron (use optimus)"),
        (["--coreset-pool-ratio", "2", "--coreset-lookahead"], "--coreset-lookahead"),
    ],
)
def test_pretrain_refuses_the_split_where_it_cannot_run(extra, msg, monkeypatch):
    from tests.pretrain_runs import refused

    pp2 = ["--pipeline-model-parallel-size", "2", "--encoder-wgrad-split"]
    refused([*pp2, *extra], f"--encoder-wgrad-split does not run with {msg}", monkeypatch)


def test_pretrain_trains_with_the_split_backward():
    """pretrain_mllm.py --encoder-wgrad-split: the start-up plan keeps the split (EW actions),
    says so, the in-job re-plan keeps it too, and the losses are the unsplit run's."""
    from tests.pretrain_runs import COMMON, assert_trains_as_without

    pp2 = [*COMMON, "--pipeline-model-parallel-size", "2", "--train-iters", "3",
           "--encoder-pipeline-model-parallel-size", "2",
           "--encoder-tensor-model-parallel-size", "1", "--replan-after-iters", "1"]  # fmt: skip
    said = "backward split, weight gradients in later bubbles"
    assert_trains_as_without(pp2, "--encoder-wgrad-split", said, "; --encoder-wgrad-split kept")


def test_a_deferred_linear_gives_megatron_cores_gradients_for_an_odd_strided_gradient():
    """The deferred linear's input, bias and (after apply) weight gradients are megatron-core's
    own linear's, also for an output gradient with an odd stride on a size-1 dimension (as the
    projector's arrives; the deferred one works on it as a plain matrix)."""
    import torch

    from megatron_mllm.runtime.engine.weight_grads import DeferredWeightGrads, _DeferredLinear

    torch.manual_seed(0)
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce as megatron_linear,
    )

    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))
    x = torch.randn(5, 1, 4)
    grad = torch.randn(5, 6).as_strided((5, 1, 6), (6, 30, 1))  # stride 30 on the size-1 dim
    assert grad.is_contiguous()
    a = x.clone().requires_grad_()
    megatron_linear(a, w, b, False, False, False).backward(grad)
    expected = (a.grad, w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    store, c = DeferredWeightGrads([]), x.clone().requires_grad_()
    with store.unit(("u",)):
        _DeferredLinear.apply(c, w.detach(), b, (w,), store, None).backward(grad)
    assert w.grad is None and torch.equal(c.grad, expected[0]) and torch.equal(b.grad, expected[2])
    store.apply(("u",))
    torch.testing.assert_close(w.grad, expected[1], rtol=0, atol=1e-6)


def test_a_deferred_weight_gradient_reaches_its_parameter_without_a_copy():
    """The weight product made by `apply` is the tensor the parameter's accumulator keeps (a
    gradient passed in from Python would be copied there: a second pass over every weight)."""
    import torch

    from megatron_mllm.runtime.engine.weight_grads import DeferredWeightGrads

    w = torch.nn.Parameter(torch.randn(6, 4))
    store = DeferredWeightGrads([])
    x, grad = torch.randn(5, 4), torch.randn(5, 6)
    with store.unit(("u",)):
        store.keep(w, x, grad)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert store.apply(("u",)) == 1
    ops = {e.name for e in prof.events()}
    assert "aten::mm" in ops and not ops & {"aten::clone", "aten::copy_"}, sorted(ops)
    torch.testing.assert_close(w.grad, grad.t() @ x, rtol=0, atol=0)
