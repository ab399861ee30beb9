"""The backbone's backward split where a peer waits for it (zero-bubble's B / W): B computes the
input gradient, W the weight gradients in a later bubble. The IR carries W through validator
and simulator, the planner keeps the split only where it predicts a gain, and the executor's
split steps give the one-process reference's losses and gradients."""

from dataclasses import replace

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import BENCH, TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.planning.schedules import job_of
from megatron_mllm.schedule.actions import parse_action
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
from megatron_mllm.schedule.planner import plan_optimus
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, validate

N = 6
REVERSED = ParallelPlan(1, 1, 2, 1, True)


@pytest.fixture(scope="module")
def split():
    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit="layer")
    opts = OptimusOptions(REVERSED, split="even")
    plain = optimus_schedule(costs, opts)
    return plain, optimus_schedule(costs, replace(opts, backbone_wgrad_split=True))


def test_the_last_stage_splits_its_first_backward_and_every_stage_its_last(split):
    _, (schedule, wl) = split
    assert schedule.meta.backbone_wgrad == ((0, 0, N - 1), (1, 0, 0), (1, 0, N - 1))
    ws = {str(a) for acts in schedule.ranks for a in acts if a.kind == "W"}
    assert ws == {"W:s0v0m5", "W:s1v0m0", "W:s1v0m5"}
    assert parse_action("W:s1v0m0").kind == "W"
    whole = sum(k.compute_s for k in wl.kernels("B", 1))
    parts = wl.kernels("B", 1, split=True) + wl.kernels("W", 1)
    assert sum(k.compute_s for k in parts) == pytest.approx(whole)
    assert sum(k.comm_s for k in wl.kernels("W", 1)) == 0


def test_a_split_schedule_validates_simulates_faster_and_round_trips(split):
    (plain_schedule, plain), (schedule, wl) = split
    validate(schedule)
    again = Schedule.from_csv(schedule.to_csv())
    assert again.meta == schedule.meta and again.ranks == schedule.ranks
    sim, base = simulate(schedule, wl), simulate(plain_schedule, plain)
    assert sim.limit_s == pytest.approx(base.limit_s)  # the same work in all
    # rank 0 gets the first gradient sooner: its first backward starts earlier
    first_b = [min(t[0] for (r, i), t in s.action_times.items() if r == 0 and
                   sched.ranks[0][i].kind == "B") for s, sched in
               ((sim, schedule), (base, plain_schedule))]  # fmt: skip
    assert first_b[0] < first_b[1]
    assert sim.step_time_s < base.step_time_s


def test_w_must_follow_its_b_and_come_before_the_reduction(split):
    _, (schedule, _) = split
    ranks = [list(acts) for acts in schedule.ranks]
    w = next(i for i, a in enumerate(ranks[1]) if str(a) == "W:s1v0m0")
    ranks[1].insert(0, ranks[1].pop(w))
    with pytest.raises(ScheduleError, match=r"at W:s1v0m0: \[order\] .*bwd.s1v0.m0"):
        validate(Schedule(schedule.meta, ranks))
    ranks = [[a for a in acts if str(a) != "W:s1v0m0"] for acts in schedule.ranks]
    with pytest.raises(ScheduleError, match=r"\[missing\] no W:s1v0m0 on rank 1"):
        validate(Schedule(schedule.meta, ranks))
    unsplit = replace(schedule.meta, backbone_wgrad=schedule.meta.backbone_wgrad[:2])
    with pytest.raises(ScheduleError, match=r"\[split\] W:s1v0m5: its backward is not split"):
        validate(Schedule(unsplit, schedule.ranks))


def test_the_planner_keeps_the_backbone_split_only_where_it_pays():
    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit="layer")
    base, _, _ = plan_optimus(costs)
    best, candidates, _ = plan_optimus(costs, backbone_wgrad_split=True)
    split = [t for o, t, _ in candidates if o.backbone_wgrad_split]
    assert len(split) == 1
    assert best.options.backbone_wgrad_split == (split[0] < base.result.step_time_s)
    assert best.result.step_time_s == pytest.approx(min(split[0], base.result.step_time_s))
    # no split without a pipeline to wait on it
    one = JobCosts(job_of(BENCH, ParallelPlan(2, 1, 1), 2, N), unit="layer")
    _, candidates, _ = plan_optimus(one, backbone_wgrad_split=True)
    assert not any(o.backbone_wgrad_split for o, _, _ in candidates)
    with pytest.raises(ConfigError, match="split backbone backward needs PP >= 2"):
        optimus_schedule(one, OptimusOptions(ParallelPlan(2, 1, 1), backbone_wgrad_split=True))


def test_each_w_follows_its_b_when_the_encoders_gather_delays_the_backbone():
    """With the encoder data-parallel (its parameter all-gather pushes the backbone back) every
    W still lands after its own B, and the schedule validates."""
    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit="layer")
    opts = OptimusOptions(ParallelPlan(2, 1, 1), split="even", backbone_wgrad_split=True)
    schedule, _ = optimus_schedule(costs, opts)
    validate(schedule)
    for acts in schedule.ranks:
        at = {str(a): i for i, a in enumerate(acts)}
        for a in (a for a in acts if a.kind == "W"):
            assert at[str(a)] > at[f"B:s{a.stage}v{a.chunk}m{a.mb}"], a


def test_the_megatron_schedule_splits_the_same_backwards():
    """The ablation: the Megatron schedule (encoder on stage 0) with the same split backwards,
    each W in the first idle stretch after its B that holds it, else before the RS."""
    from megatron_mllm.schedule.baselines import megatron_schedule

    costs = JobCosts(job_of(BENCH, ParallelPlan(1, 1, 2), 2, N), unit="layer")
    plain, (schedule, wl) = megatron_schedule(costs), megatron_schedule(costs, False, True)
    validate(schedule)
    assert schedule.meta.backbone_wgrad == ((0, 0, N - 1), (1, 0, 0), (1, 0, N - 1))
    rank0 = [str(a) for a in schedule.ranks[0] if a.is_compute or a.kind == "RS"]
    # stage 0's last input gradient feeds the encoder's backward first
    assert rank0[-5:-1] == ["B:s0v0m5", "EB:e0p0s0m5k0-8", "W:s0v0m5", "RS:bb"], rank0
    assert simulate(schedule, wl).step_time_s < simulate(*plain).step_time_s
    # --bubble-schedule balanced --backbone-wgrad-split keeps it (predicted faster)
    from megatron_mllm.runtime.planning.schedules import runtime_schedule

    kept = runtime_schedule(BENCH, ParallelPlan(1, 1, 2), 2, N, "balanced",
                            backbone_wgrad_split=True)  # fmt: skip
    assert kept.ranks == schedule.ranks


@pytest.mark.parametrize(
    "layout",
    ["reversed", "megatron", pytest.param("first-recompute", marks=pytest.mark.slow)],
)
def test_the_executor_runs_a_split_backbone_backward_as_the_reference(layout):
    """B keeps its linears' weight products, W turns them into weight gradients through DDP's
    hooks (overlapped reduction in small buckets; then megatron-core's distributed optimizer):
    three steps give the one-process reference's losses, step 0's gradients match, every W ran.
    With the backbone's layers recomputed, their forward runs again inside B and defers too."""
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from megatron_mllm.schedule.config import Recompute
    from tests.test_runtime import TRAIN, check_against, check_both_optimizers, reference_of

    plan, n = ParallelPlan(1, 1, 2), 4
    enc_plan = ParallelPlan(1, 1, 2, 1, layout == "reversed")
    recompute = Recompute("full", "uniform", 1) if layout.endswith("recompute") else Recompute()
    state, ref = reference_of(TINY, **dict(TRAIN, steps=3))
    if layout == "megatron":
        from megatron_mllm.schedule.baselines import megatron_schedule

        costs = JobCosts(job_of(TINY, plan, 1, n), unit="layer")
        schedule = megatron_schedule(costs, even_split=True, backbone_wgrad_split=True)[0]
    else:
        schedule = runtime_schedule(TINY, plan, 1, n, "optimus", encoder_plan=enc_plan,
                                    backbone_wgrad_split=True)  # fmt: skip
    opt = replace(TRAIN["optimizer"], overlap_grad_reduce=True, ddp_bucket_size=20_000)
    job = RuntimeJob(ModelParts(TINY, state, recompute=recompute), PlanParts(plan, schedule),
                     DataParts(1, n), steps=3, optimizer=opt)  # fmt: skip
    outs = spawn(run_rank, plan.world_size, job)
    check_against((state, ref), outs, {"backbone": 1, "encoder": 1, "projector": 1})
    ran = {str(s.action) for o in outs for s in o["spans"] if s.action.kind == "W"}
    assert ran == {str(a) for acts in schedule.ranks for a in acts if a.kind == "W"} != set()
    # every W computed its linears' weights: 4 a layer (qkv, proj, fc1, fc2), the output layer's
    per_rank = {o["coords"].stage: o["deferred_products"] for o in outs}
    layers = TINY.llm_layers // 2
    assert per_rank == {0: 4 * layers, 1: 2 * (4 * layers + 1)}, per_rank
    check_both_optimizers(ref, job, outs, plan.world_size)


@pytest.mark.parametrize(
    "model, sp, msg",
    [({"transformer_impl": "transformer_engine"}, False, "--transformer-impl transformer_engine"),
     ({}, True, "--sequence-parallel")],
)  # fmt: skip
def test_layers_that_cannot_defer_refuse_a_split_backbone_schedule(split, model, sp, msg):
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob, check_job

    _, (schedule, _) = split
    job = RuntimeJob(
        ModelParts(BENCH, {}, **model),
        PlanParts(ParallelPlan(1, 1, 2), schedule=schedule, sequence_parallel=sp),
        DataParts(2, N),
    )
    with pytest.raises(ConfigError, match=f"split backbone backward .*{msg} does not allow"):
        check_job(job, 2)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--bubble-schedule", "optimus-adaptive"], "--bubble-schedule optimus-adaptive"),
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            "--recompute-granularity full",
        ),
        (["--coreset-pool-ratio", "2", "--coreset-lookahead"], "--coreset-lookahead"),
    ],
)
def test_pretrain_refuses_the_backbone_split_where_it_cannot_run(extra, msg, monkeypatch):
    from tests.pretrain_runs import refused

    pp2 = ["--pipeline-model-parallel-size", "2", "--backbone-wgrad-split"]
    refused([*pp2, *extra], f"--backbone-wgrad-split does not run with {msg}", monkeypatch)


def test_pretrain_refuses_the_backbone_split_without_a_pipeline_or_with_tp(monkeypatch):
    from tests.pretrain_runs import refused

    refused(["--backbone-wgrad-split"], "use --pipeline-model-parallel-size 2 or more", monkeypatch)
    tp2 = ["--backbone-wgrad-split", "--pipeline-model-parallel-size", "2"]
    tp2 += ["--tensor-model-parallel-size", "2"]
    refused(tp2, "runs at --tensor-model-parallel-size 1", monkeypatch, world=4)


def test_pretrain_trains_with_the_backbone_split():
    """pretrain_mllm.py --backbone-wgrad-split: the start-up plan keeps the split (W actions),
    says so, the in-job re-plan keeps it too, and the losses are the unsplit run's."""
    from tests.pretrain_runs import COMMON, assert_trains_as_without

    pp2 = [*COMMON, "--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    said = "backward split at 3 (stage, micro-batch) points"
    replan = "; --backbone-wgrad-split kept"
    assert_trains_as_without(
        [*pp2, "--replan-after-iters", "1"], "--backbone-wgrad-split", said, replan
    )


@pytest.mark.slow  # 12 s
def test_a_split_backward_in_the_references_order_trains_bit_exactly():
    """With each W moved right after its own B (the fp32 gradient sums in the reference's
    order), ten steps of Adam give the one-process reference's losses exactly, and the weight
    products were deferred all the same; where W runs later only the order of the sums
    differs (step 0's gradients within 1e-6 relative)."""
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import TRAIN, check_grads, reference_of

    plan, n, steps = ParallelPlan(1, 1, 2), 4, 10
    state, ref = reference_of(TINY, **dict(TRAIN, steps=steps))
    split = runtime_schedule(TINY, plan, 1, n, "optimus", encoder_plan=REVERSED,
                             backbone_wgrad_split=True)  # fmt: skip
    ranks = [list(acts) for acts in split.ranks]
    for acts in ranks:
        for w in [a for a in acts if a.kind == "W"]:
            acts.remove(w)
            b = next(i for i, a in enumerate(acts) if str(a) == f"B:s{w.stage}v0m{w.mb}")
            acts.insert(b + 1, w)
    in_order = Schedule(split.meta, ranks)
    validate(in_order)
    outs = {}
    for name, schedule in (("in order", in_order), ("split", split)):
        job = RuntimeJob(ModelParts(TINY, state), PlanParts(plan, schedule), DataParts(1, n),
                         steps=steps, optimizer=TRAIN["optimizer"])  # fmt: skip
        outs[name] = spawn(run_rank, plan.world_size, job)
    for step, losses in enumerate(ref["history"]):
        mine = {k: v for o in outs["in order"] for k, v in o["history"][step].items()}
        assert mine == losses, step
    assert sorted(o["deferred_products"] for o in outs["in order"]) == [8, 18]
    check_grads((state, ref), outs["split"], {"backbone": 1, "encoder": 1, "projector": 1})
