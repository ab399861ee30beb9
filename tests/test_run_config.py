"""One run configuration: pretrain_mllm.py's checked arguments typed once (RunConfig), the
schedule choice as one value, and the benchmarks' runs built through the same arguments."""

import argparse
import copy

import pytest

from megatron_mllm.schedule.choice import ScheduleChoice
from megatron_mllm.training.run_config import RunConfig, parse_run

ARGS = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--bf16",
        "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method",
        "uniform", "--recompute-num-layers", "1"]  # fmt: skip


def test_from_args_reads_the_arguments_and_changes_none():
    from megatron_mllm.training.arguments import parse_args

    args = parse_args([*ARGS, "--bubble-schedule", "optimus-adaptive"], world_size=2)
    before = copy.deepcopy(vars(args))
    run = RunConfig.from_args(args)
    assert vars(args) == before
    assert args.bubble_schedule == "optimus-adaptive"  # as given, in the saved arguments too
    assert run.schedule is ScheduleChoice.OPTIMUS_ADAPTIVE and run.schedule.per_step
    assert (run.plan.dp, run.plan.pp, run.num_microbatches) == (1, 2, 8)
    job = run.runtime_job(None, {})
    assert job.model.precision == "bf16" and job.optimizer.distributed
    assert job.model.recompute == run.recompute and run.recompute.granularity == "full"
    assert job.executor.adaptive and not job.data.balance_samples  # no per-token loss
    assert run.planning_job().recompute == run.recompute


@pytest.mark.parametrize(
    "given, planned, per_step",
    [("megatron", "megatron", False), ("balanced", "balanced", False),
     ("optimus", "optimus", False), ("optimus-adaptive", "optimus", True)],
)  # fmt: skip
def test_the_schedule_choice_says_what_is_planned_and_whether_per_step(given, planned, per_step):
    run = parse_run([*ARGS, "--bubble-schedule", given], world_size=2)
    assert (run.schedule.planned, run.schedule.per_step, str(run.schedule)) == (
        planned,
        per_step,
        given,
    )
    schedule, _ = run.static_plan()
    assert schedule.meta.encoder_on_stage0 == (planned != "optimus")
    assert (schedule.origin is not None) == (planned == "optimus")


def test_a_benchmark_run_is_the_pretrain_run_of_the_same_arguments():
    from bench_common import bench_run

    from megatron_mllm.models.config import BENCH
    from megatron_mllm.parallel.plans import ParallelPlan

    run = bench_run(BENCH, argparse.Namespace(precision="bf16"), ParallelPlan(1, 1, 2), 4, 2)
    assert run.model == BENCH and (run.micro_batch, run.num_microbatches) == (2, 4)
    opt = run.runtime_job(None, {}).optimizer
    assert (opt.distributed, opt.overlap_grad_reduce, opt.overlap_param_gather) == (True,) * 3
    assert opt.grad_reduce_in_fp32 and opt.lr == 1e-4
