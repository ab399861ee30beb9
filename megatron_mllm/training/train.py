"""The training job behind pretrain_mllm.py: plan, build, then the loop (step, log, validate,
re-plan, save) and the trace export. Arguments <-> model: model_args.py; log lines: log.py;
checkpoint contents and resume: resume.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megatron_mllm.errors import ConfigError, RunStopped, exit_on_config_error
from megatron_mllm.training.iteration_hooks import (
    ExitSignal,
    SavePolicy,
    Validation,
    check_corrupted,
    export_trace,
    not_finite_step,
    truncated_samples,
)
from megatron_mllm.training.log import (
    dry_run_summary,
    log_line,
    lookahead_line,
    replan_line,
    startup_summary,
)
from megatron_mllm.training.model_args import initial_weights
from megatron_mllm.training.run_config import RunConfig

if TYPE_CHECKING:
    from megatron_mllm.runtime.job import FaultHooks


@exit_on_config_error
def main(argv: list[str] | None = None, faults: FaultHooks | None = None) -> int:
    """pretrain_mllm.py: train as `argv` says; `faults`: injected failures (tests only)."""
    from megatron_mllm.training.arguments import parse_args

    args = parse_args(argv)
    run = RunConfig.from_args(args)
    if args.dry_run:
        print(dry_run_summary(run))
        return 0
    if args.save and args.rank == 0:  # one run per --save directory (released at exit)
        from megatron_mllm.training.save_lock import acquire

        acquire(args.save)
    phase, kept = plan_candidates_of(run)
    if kept is not None:  # resumed after the candidate phase: the plan it kept
        schedule, workload = kept
    elif phase is not None:
        schedule, workload = phase.candidates[0].schedule, phase.candidates[0].workload
    else:
        schedule, workload = run.static_plan()
    layers = schedule.meta.backbone_layers
    if run.plan.vpp > 1 and len(set(layers)) > 1:
        raise ConfigError(
            f"the planned backbone split {list(layers)} is uneven, which an interleaved "
            "backbone cannot run; use --bubble-schedule megatron"
        )
    from megatron_mllm.schedule.simulator import simulate

    predicted = simulate(schedule, workload)
    pools = coreset_schedules(run, schedule, workload)
    return _train(run, schedule, pools, predicted, phase, faults)


def plan_candidates_of(run: RunConfig) -> tuple:
    """(the candidate phase, None) for --plan-candidates; (None, (schedule, workload)) where
    --load holds a checkpoint saved after the phase (its kept plan trains on); (None, None)
    without candidates."""
    args = run.args
    if not args.plan_candidates:
        return None, None
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.training.plan_candidates import CandidatePhase, kept_plan, plan_candidates

    costs = JobCosts(run.planning_job(), unit=args.fill_granularity)
    if args.load:
        from megatron_mllm.training.checkpointing import read_common

        kept = kept_plan(read_common(args.load), costs)
        if kept is not None:
            return None, kept
    k, splits = args.plan_candidates, (args.encoder_wgrad_split, args.backbone_wgrad_split)
    cands = tuple(plan_candidates(costs, k, args.fill_granularity, *splits))
    warmup = args.plan_candidate_layout_warmup
    return CandidatePhase(cands, args.plan_candidate_steps, layout_warmup=warmup), None


def coreset_schedules(run: RunConfig, schedule, workload) -> tuple:
    """The coreset pool's forward-only schedule (for the step's own modules) and, with
    --coreset-lookahead, the step's schedule with the next pool merged in; (None, None)
    without a coreset."""
    args = run.args
    if args.coreset is None:
        return None, None
    from megatron_mllm.runtime.planning.schedules import pool_plan

    size = args.coreset.pool_size // run.micro_batch
    pool, _ = pool_plan(
        schedule,
        run.model,
        run.plan,
        run.micro_batch,
        size,
        unit=args.fill_granularity,
        frozen_encoder=args.freeze_ViT,
    )
    if not args.coreset_lookahead:
        return pool, None
    from megatron_mllm.schedule.lookahead import lookahead_merge

    order = args.coreset_lookahead_order
    return pool, lookahead_merge(schedule, pool, workload, order, counts=range(1, size))


def _train(run_config: RunConfig, schedule, pools, predicted, phase=None, faults=None) -> int:
    import torch.distributed as dist

    from megatron_mllm.models.weights import shapes_of
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.job import encoder_plan_of
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun
    from megatron_mllm.training.resume import Checkpointer

    args, plan = run_config.args, run_config.plan
    rank, world = args.rank, args.world_size
    device = init_rank(rank, world, args.seed, args.distributed_timeout_minutes * 60)
    enc_plan, stage0 = encoder_plan_of(schedule, plan)
    units = "layer" if stage0 else args.fill_granularity
    probe = build_colocated_groups(plan, plan if stage0 else enc_plan, world, rank)
    state = initial_weights(run_config.model, args.seed, probe)
    full_shapes = shapes_of(state)  # drawing none of the weights
    job = run_config.runtime_job(schedule, state, pools, units, faults)
    if phase is not None:
        from megatron_mllm.training.candidate_run import CandidateRun

        run = CandidateRun(rank, world, job, device, phase)
    else:
        run = ExecutorRun(rank, world, job, device)
    scheduler = lr_scheduler(args, run.optimizer)
    if phase is not None:
        run.on_switch = lambda new: follow(scheduler, new.optimizer)
    checkpointer = Checkpointer(args, run, full_shapes, scheduler)
    start = 0
    if args.load:
        start, what = checkpointer.load()
        if rank == 0:
            print(f" loaded checkpoint from {args.load}: {what}", flush=True)
    if rank == 0:
        summary = startup_summary(run_config, enc_plan, stage0, predicted, schedule)
        print(summary, flush=True)
        if job.data.lookahead_schedule is not None:
            times = job.data.lookahead_schedule.lookahead_times
            print(lookahead_line(times, args.coreset_lookahead_order), flush=True)
        if phase is not None:
            print(run.startup_line(), flush=True)
        elif args.plan_candidates:
            print(
                " > plan candidates: the plan the checkpoint's candidate phase kept trains on "
                "(no new phase)",
                flush=True,
            )
    validation = Validation(args, run, device) if args.eval_iters and job.data.llava else None
    _loop(args, run, scheduler, checkpointer, validation, start, device)
    if validation is not None:
        validation.report(args.train_iters, final=True)
        validation.close()
    if args.trace:
        export_trace(args, run.spans, world, rank)
    plans = run.adaptive.close() if run.adaptive is not None else None
    if plans is not None and rank == 0:
        print(f" > {plans}", flush=True)
    if run.coreset is not None:
        run.coreset.settle()  # look-ahead: no broadcast left pending
    run.data.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def follow(scheduler, optimizer) -> None:
    """The LR scheduler drives `optimizer` from now on, at its current learning rate."""
    scheduler.optimizer = optimizer
    scheduler.step(0)


def lr_scheduler(args, optimizer):
    """megatron-core's OptimizerParamScheduler as Megatron's arguments configure it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_mllm.training.resume_contract import schedule_values

    v = {key: value for key, (_, value) in schedule_values(args).items()}
    return OptimizerParamScheduler(
        optimizer,
        0.0,
        v["max_lr"],
        v["min_lr"],
        v["lr_warmup_steps"],
        v["lr_decay_steps"],
        v["lr_decay_style"],
        v["start_wd"],
        v["start_wd"],  # constant weight decay
        v["lr_decay_steps"],
        "constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def _loop(args, run, scheduler, checkpointer, validation, start: int, device) -> None:
    """Iterations `start` .. --train-iters: step, log, validate, re-plan, save."""
    writer = None
    if args.tensorboard_dir and args.rank == args.world_size - 1:  # Megatron: the last rank
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.log_interval)
    skipped = nan = 0  # since the last log line, as Megatron counts them
    saves = SavePolicy(args, run, checkpointer)
    if args.save and args.max_param_norm_growth:
        checkpointer.reference_norm()
    signals = ExitSignal(args.exit_signal) if args.exit_signal_handler else None
    nan_run, logged = 0, start  # NaN or Inf steps in a row; the last logged iteration
    for it in range(start, args.train_iters):
        t0, before = time.perf_counter(), run.skipped_iterations
        run.step(it)  # its loss reduction ends it
        lr = run.optimizer.param_groups[0]["lr"]
        applied = run.skipped_iterations == before
        if applied:  # Megatron advances the schedule only for applied steps
            scheduler.step(1)
        mean = run.last_loss
        ms = 1000 * (time.perf_counter() - t0)
        not_finite = not_finite_step(mean, run.last_grad_norm, args.fp16)
        skipped, nan = skipped + (not applied), nan + not_finite
        nan_run = nan_run + 1 if not_finite else 0
        log_now = (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters
        truncated = truncated_samples(run, device) if log_now and run.data.streams else None
        check_corrupted(args, truncated, checkpointer.consumed(it + 1))
        if args.rank == 0 and log_now:
            line = log_line(
                it + 1,
                args.train_iters,
                checkpointer.consumed(it + 1),
                ms,
                lr,
                args.global_batch_size,
                mean,
                run.last_grad_norm,
                skipped,
                nan,
                run.loss_scale,
                truncated,
                packed=args.packing_buffer_size is not None,
            )
            print(line, flush=True)
        if log_now and args.timing_log_level:
            _log_timings(args, run, it + 1 - logged, device)
        logged = it + 1 if log_now else logged
        if (it + 1) % args.log_interval == 0:
            skipped = nan = 0
        if args.check_for_nan_in_loss_and_grad and nan_run >= args.max_skipped_iterations:
            raise RunStopped(
                f"{nan_run} iterations in a row (the last {it + 1}) had a NaN or Inf loss or "
                f"gradient norm and were skipped (--max-skipped-iterations "
                f"{args.max_skipped_iterations}); stopped, {checkpointer.latest_saved()}"
            )
        if writer is not None:
            for name, value in (
                ("lm loss", mean),
                ("learning-rate", lr),
                ("grad-norm", run.last_grad_norm),
                ("iteration-time", ms / 1000),
            ):
                writer.add_scalar(name, value, it + 1)
            writer.add_scalar("lm loss vs samples", mean, (it + 1) * args.global_batch_size)
        if args.replan_after_iters == it + 1:
            _replan(run, args.rank)
        if validation is not None and args.eval_interval and (it + 1) % args.eval_interval == 0:
            if it + 1 < args.train_iters:  # the last iteration's comes after the loop
                validation.report(it + 1)
        _candidate_phase_step(args, run, it + 1)
        saves.after(it + 1, nan_run)
        if signals is not None and signals.received(device):
            saves.after(it + 1, nan_run, last=True)
            if args.rank == 0:
                print(
                    f" > {signals.name} received: stopped after iteration {it + 1}, "
                    f"{checkpointer.latest_saved()}",
                    flush=True,
                )
            break
    else:
        saves.after(args.train_iters, nan_run, last=True)
    if writer is not None:
        writer.close()


def _log_timings(args, run, steps: int, device) -> None:
    """--timing-log-level: every rank's breakdown of the last `steps` steps, printed by rank 0
    under the iteration line (a collective: every rank calls it)."""
    from megatron_mllm.training.timing_log import gather_timings, timing_lines

    ranks = gather_timings(run.breakdowns[-steps:], args.timing_log_level, device)
    if args.rank == 0:
        print(timing_lines(ranks, args.timing_log_option), flush=True)


def _candidate_phase_step(args, run, iteration: int) -> None:
    """At the end of the plan-candidate phase: its table."""
    if getattr(run, "phase", None) is not None and iteration == run.phase_end and args.rank == 0:
        print(run.table(), flush=True)


def _replan(run, rank: int) -> None:
    """--replan-after-iters: plan again from the unit times measured so far (collective); rank
    0 says what came of it, how long it took and, under look-ahead, the merge made again."""
    began = time.perf_counter()
    replanned = run.replan()
    if rank == 0:
        took = f" ({time.perf_counter() - began:.1f} s)"
        print(replan_line(run.replanned if replanned else None) + took, flush=True)
        data = run.job.data
        if replanned and data.lookahead_schedule is not None:
            times = data.lookahead_schedule.lookahead_times
            print(lookahead_line(times, data.lookahead_order), flush=True)
