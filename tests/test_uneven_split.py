"""Uneven backbone splits (Megatron's --decoder-first/last-pipeline-num-layers, or the closest
to even megatron-core can build): the split rule, the refusals, and training under them."""

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.partition import first_last_split
from tests.pretrain_runs import COMMON, losses, refused, torchrun


@pytest.mark.parametrize(
    "layers,pp,first,last,expected",
    [
        (8, 4, None, None, [2, 2, 2, 2]),
        (10, 4, None, None, [2, 3, 3, 2]),  # not divisible: first and last take the rest
        (5, 2, None, None, [2, 3]),
        (10, 4, 1, None, [1, 3, 3, 3]),  # Megatron: the rest even over the other stages
        (9, 4, None, 3, [2, 2, 2, 3]),
        (10, 4, 3, 3, [3, 2, 2, 3]),
    ],
)
def test_the_split_is_one_megatron_core_can_build(layers, pp, first, last, expected):
    assert first_last_split(layers, pp, first, last) == expected


def test_a_split_that_leaves_the_middle_uneven_is_refused():
    with pytest.raises(ConfigError, match="cannot be split over PP 4 stages"):
        first_last_split(10, 4, 1, 2)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "4"],
         "--decoder-first-pipeline-num-layers 4: give 1 to 3"),
        (["--decoder-last-pipeline-num-layers", "1"], "need PP > 1"),
        (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
          "--bubble-schedule", "balanced"], "chooses its own uneven split"),
    ],
)  # fmt: skip
def test_bad_splits_are_refused_in_one_line(args, msg, monkeypatch):
    refused(args, msg, monkeypatch)


def test_a_fixed_uneven_split_trains_like_one_stage():
    """PP=2 with one layer on the first stage (megatron schedule) and PP=1: the same model from
    the same canonical weights, so the same losses."""
    model = [*COMMON, "--num-layers", "5", "--train-iters", "3"]
    one = torchrun(*model, nproc=1)
    assert one.returncode == 0, one.stderr[-2000:]
    split = torchrun(
        *model, "--pipeline-model-parallel-size", "2", "--bubble-schedule", "megatron",
        "--decoder-first-pipeline-num-layers", "1",
    )  # fmt: skip
    assert split.returncode == 0, split.stderr[-2000:]
    ref, got = losses(one.stdout), losses(split.stdout)
    assert sorted(got) == [1, 2, 3] and all(abs(got[i] - ref[i]) < 1e-4 for i in ref)


@pytest.mark.slow  # four ranks
@pytest.mark.parametrize("schedule", ["megatron", "optimus"])
def test_layers_that_pp_does_not_divide_train_under_every_schedule(schedule):
    args = ["--pipeline-model-parallel-size", "4", "--num-layers", "10", "--bubble-schedule",
            schedule, *COMMON, "--train-iters", "2"]  # fmt: skip
    out = torchrun(*args, nproc=4)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(losses(out.stdout)) == [1, 2]


def test_the_runtime_accepts_the_uneven_splits_the_planner_makes():
    """check_job (also called by online re-planning) accepts a schedule whose backbone split is
    the planner's closest-to-even one (5 layers on PP 2: 2/3), and megatron-core's own schedule
    with a first-stage override whose rest splits evenly; it refuses what megatron-core cannot
    build."""
    from dataclasses import replace

    from megatron_mllm.models.config import TINY
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob, check_job
    from megatron_mllm.runtime.planning.schedules import runtime_schedule

    cfg, plan = replace(TINY, llm_layers=5), ParallelPlan(1, 1, 2)
    for name in ("megatron", "optimus"):
        schedule = runtime_schedule(cfg, plan, 1, 4, name, backbone_split=(2, 3))
        assert list(schedule.meta.backbone_layers) == [2, 3]
        check_job(RuntimeJob(ModelParts(cfg, {}), PlanParts(plan, schedule), DataParts(1, 4)), 2)
    core = PlanParts(plan, backbone_first_stage_layers=2)
    check_job(RuntimeJob(ModelParts(cfg, {}), core, DataParts(1, 4), mode="megatron_core"), 2)
    with pytest.raises(ConfigError, match="do not split evenly over PP 2"):
        job = RuntimeJob(
            ModelParts(cfg, {}), PlanParts(plan), DataParts(1, 4), mode="megatron_core"
        )
        check_job(job, 2)
    four = ParallelPlan(1, 1, 4)
    cfg10 = replace(TINY, llm_layers=10)
    schedule = runtime_schedule(cfg10, four, 1, 4, "megatron", backbone_split=(2, 3, 3, 2))
    check_job(RuntimeJob(ModelParts(cfg10, {}), PlanParts(four, schedule), DataParts(1, 4)), 4)
    bad = replace(schedule, meta=replace(schedule.meta, backbone_layers=(2, 2, 4, 2)))
    with pytest.raises(ConfigError, match="middle stages must hold equal layer counts"):
        check_job(RuntimeJob(ModelParts(cfg10, {}), PlanParts(four, bad), DataParts(1, 4)), 4)


def test_re_planning_keeps_every_input_of_the_static_plan():
    """The planning job a running job re-plans from (re-planning, optimus-adaptive, the plan
    candidates) is the one its static plan was made from: recomputation, encoder load and the
    uneven split it built, not a job rebuilt from part of them."""
    from dataclasses import replace

    from megatron_mllm.models.config import TINY
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.job import (
        DataParts,
        ExecutorSettings,
        ModelParts,
        PlanParts,
        RuntimeJob,
    )
    from megatron_mllm.runtime.planning.replan import replan_job
    from megatron_mllm.runtime.planning.schedules import job_of, planning_job, runtime_plan
    from megatron_mllm.schedule.config import Recompute

    cfg, plan = replace(TINY, llm_layers=5), ParallelPlan(1, 1, 2)
    rc = Recompute("full", "uniform", 1)
    inputs = dict(recompute=rc, images_per_sample=2.0, backbone_split=(2, 3))
    schedule, _ = runtime_plan(cfg, plan, 1, 4, "optimus", **inputs)
    job = RuntimeJob(
        ModelParts(cfg, {}, recompute=rc),
        PlanParts(plan, schedule),
        DataParts(1, 4),
        executor=ExecutorSettings(images_per_sample=2.0),
    )
    assert planning_job(job) == job_of(cfg, plan, 1, 4, **inputs)
    # Re-planned from the analytic times themselves, the plan is the one it was.
    assert replan_job(job, [{}])[0].ranks == schedule.ranks
