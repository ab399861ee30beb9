"""The training job behind pretrain_mllm.py: plan, build, train, log, checkpoint."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch

from megatron_mllm.errors import ConfigError, exit_on_config_error
from megatron_mllm.models.config import CLIP_VIT, MLLMConfig
from megatron_mllm.parallel.plans import ParallelPlan, colocated_encoder_plan
from megatron_mllm.schedule.config import Recompute


def _encoder_fields(
    arch: str | None,
    activation: str | None,
    image_size: int,
    patch_size: int,
    channels: int,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int | None,
) -> dict:
    """MLLMConfig's encoder fields for one encoder (the first or an --extra-encoder)."""
    fields = dict(CLIP_VIT) if arch == "clip" else {}
    if activation:
        fields["vit_activation"] = activation
    return dict(
        fields,
        image_size=image_size,
        patch_size=patch_size,
        channels=channels,
        vit_layers=layers,
        vit_hidden=hidden,
        vit_heads=heads,
        vit_ffn=ffn,
    )


def model_config(args: argparse.Namespace) -> MLLMConfig:
    """The model the arguments describe (see arguments.MODEL_ARGS and `model_args`)."""
    encoder = _encoder_fields(
        args.encoder_arch,
        args.encoder_activation,
        args.img_h,
        args.patch_dim,
        args.num_channels,
        args.encoder_num_layers,
        args.encoder_hidden_size,
        args.encoder_num_attention_heads,
        args.encoder_ffn_hidden_size,
    )
    cfg = MLLMConfig(
        **encoder,
        llm_layers=args.num_layers,
        llm_hidden=args.hidden_size,
        llm_heads=args.num_attention_heads,
        llm_ffn=args.ffn_hidden_size,
        vocab_size=args.vocab_size,
        text_len=args.seq_length,
        projector_bias=not args.disable_projector_bias,
        llm_normalization=args.normalization,
        llm_norm_eps=args.norm_epsilon,
        llm_swiglu=args.swiglu,
        llm_bias=not args.disable_bias_linear,
        llm_query_groups=args.num_query_groups if args.group_query_attention else None,
        rope_base=args.rotary_base,
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
        attention_dropout=getattr(args, "attention_dropout", 0.0),
        extra_encoders=tuple(
            extra_encoder_config(spec, args) for spec in getattr(args, "extra_encoder", [])
        ),
    )
    cfg.validate(
        getattr(args, "tensor_model_parallel_size", 1),
        getattr(args, "encoder_tensor_model_parallel_size", None) or 1,
        getattr(args, "sequence_parallel", False),
    )
    return cfg


def extra_encoder_config(spec: str, args: argparse.Namespace) -> MLLMConfig:
    """An --extra-encoder SPEC as the encoder fields of an MLLMConfig (see encoder_config)."""
    from megatron_mllm.training.arguments import parse_encoder_spec

    fields = parse_encoder_spec(spec)
    return MLLMConfig(
        **_encoder_fields(
            fields.get("arch"),
            fields.get("activation"),
            fields.get("img-h", args.img_h),
            fields.get("patch-dim", args.patch_dim),
            args.num_channels,
            fields["num-layers"],
            fields["hidden-size"],
            fields["num-attention-heads"],
            fields.get("ffn-hidden-size"),
        )
    )


def _is_clip(cfg: MLLMConfig) -> bool:
    return all(getattr(cfg, k) == v for k, v in CLIP_VIT.items() if k != "vit_activation")


def encoder_spec(enc: MLLMConfig) -> str:
    """The inverse of `extra_encoder_config`: the --extra-encoder SPEC of an extra encoder."""
    spec = (
        f"num-layers={enc.vit_layers},hidden-size={enc.vit_hidden},"
        f"num-attention-heads={enc.vit_heads},img-h={enc.image_size},patch-dim={enc.patch_size},"
        f"arch={'clip' if _is_clip(enc) else 'vit'},activation={enc.vit_activation}"
    )
    return spec + (f",ffn-hidden-size={enc.vit_ffn}" if enc.vit_ffn else "")


def checkpoint_model_config(common: dict) -> MLLMConfig:
    """The model a checkpoint's common state describes (its saved arguments over defaults)."""
    from megatron_mllm.training.arguments import build_parser

    args = vars(build_parser().parse_args([]))
    args.update({k: v for k, v in common.get("args", {}).items() if k in args})
    return model_config(argparse.Namespace(**args))


def model_args(cfg: MLLMConfig) -> dict:
    """The inverse of `model_config`: argument values (MODEL_ARGS) that rebuild `cfg`."""
    clip = _is_clip(cfg)
    args = dict(
        num_layers=cfg.llm_layers,
        hidden_size=cfg.llm_hidden,
        num_attention_heads=cfg.llm_heads,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.text_len,
        encoder_num_layers=cfg.vit_layers,
        encoder_hidden_size=cfg.vit_hidden,
        encoder_num_attention_heads=cfg.vit_heads,
        img_h=cfg.image_size,
        patch_dim=cfg.patch_size,
        num_channels=cfg.channels,
        ffn_hidden_size=cfg.llm_ffn,
        encoder_ffn_hidden_size=cfg.vit_ffn,
        encoder_arch="clip" if clip else "vit",
        encoder_activation=cfg.vit_activation,
        normalization=cfg.llm_normalization,
        norm_epsilon=cfg.llm_norm_eps,
        swiglu=cfg.llm_swiglu,
        disable_bias_linear=not cfg.llm_bias,
        group_query_attention=cfg.llm_query_groups is not None,
        num_query_groups=cfg.llm_query_groups or 1,
        rotary_base=cfg.rope_base,
        disable_projector_bias=not cfg.projector_bias,
        extra_encoder=[encoder_spec(e) for e in cfg.extra_encoders],
    )
    rebuilt = model_config(argparse.Namespace(**args))
    if rebuilt != cfg:
        diff = [k for k, v in vars(cfg).items() if getattr(rebuilt, k) != v]
        raise ConfigError(f"model fields {', '.join(diff)} have no pretrain_mllm.py argument")
    return args


def initial_weights(cfg: MLLMConfig, groups) -> dict[str, torch.Tensor]:
    """Initial canonical weights, the same on every rank (an unsharded model from the seed)."""
    from megatron_mllm.models.weights import full_state
    from megatron_mllm.runtime.model_builder import build_full_model

    return full_state(*build_full_model(cfg, group=groups.solo).modules)


def mean_loss(losses: dict, device: torch.device) -> float:
    """The step's mean loss over every replica's micro-batches (collective: the last-stage ranks
    hold the losses), reduced on the ranks' device."""
    import torch.distributed as dist

    total = torch.tensor(
        [sum(losses.values()), float(len(losses))], dtype=torch.float64, device=device
    )
    dist.all_reduce(total)
    return float(total[0] / total[1])


def startup_summary(args, plan, enc_plan, stage0: bool, n_mb: int, p) -> str:
    """Both plans and the predicted bubble ratio (`p`, the simulator's result), one screen."""
    where = "whole, on backbone stage 0" if stage0 else "colocated on every backbone stage"
    if args.extra_encoder:
        where = f"{1 + len(args.extra_encoder)} encoders, each " + where
    if args.freeze_ViT:
        where += "; frozen: forward only, its projector trains"
    return "\n".join(
        [
            f" > backbone plan: {plan} (world size {plan.world_size})"
            + (", sequence parallel" if args.sequence_parallel else ""),
            f" > encoder plan:  {enc_plan} ({where})",
            f" > schedule: {args.bubble_schedule}; {n_mb} micro-batches of {args.micro_batch_size} "
            f"per step and DP replica",
            " > " + training_summary(args),
            f" > predicted by the analytic CPU cost model (uncalibrated): step "
            f"{1000 * p.step_time_s:.1f} ms, bubble ratio "
            f"{p.bubble_ratio:.1%}, zero-bubble limit {1000 * p.limit_s:.1f} ms",
        ]
    )


def dry_run_summary(args, cfg: MLLMConfig, plan: ParallelPlan, forced, n_mb: int) -> str:
    """What --dry-run prints: the checked job, without planning or touching anything."""
    vit, llm = cfg.num_params()
    enc = f"{forced} (given)" if forced else "chosen by the planner at start-up"
    return "\n".join(
        [
            " > arguments checked for world size {} ({})".format(
                plan.world_size, "dry run: nothing started"
            ),
            f" > backbone plan: {plan}{', sequence parallel' if args.sequence_parallel else ''}; "
            f"encoder plan: {enc}; schedule {args.bubble_schedule}",
            f" > encoder: {cfg.vit_layers} layers x {cfg.vit_hidden} ({vit / 1e9:.2f}B "
            f"params, all encoders), {cfg.encoder_seq_len} tokens per image"
            + (f"; {cfg.num_encoders - 1} more encoder(s)" if cfg.num_encoders > 1 else ""),
            f" > backbone: {cfg.llm_layers} layers x {cfg.llm_hidden} ({llm / 1e9:.2f}B "
            f"params), {cfg.seq_len} tokens per sample",
            f" > {n_mb} micro-batches of {args.micro_batch_size} per step and DP replica",
            " > " + training_summary(args),
        ]
    )


def training_summary(args) -> str:
    """Precision, optimizer, DP overlap and recomputation, one line."""
    opt = "distributed optimizer" if args.use_distributed_optimizer else "replicated optimizer"
    overlap = [
        name
        for name, on in (
            ("grad reduce", args.overlap_grad_reduce),
            ("param gather", args.overlap_param_gather),
        )
        if on
    ]
    rc = args.recompute_granularity or "no"
    if args.recompute_granularity == "full":
        rc += f" ({args.recompute_method}, {args.recompute_num_layers})"
    return (
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}, {opt}"
        + (f", overlapped {' and '.join(overlap)}" if overlap else "")
        + f"; {rc} backbone recomputation"
        + ("; encoder recomputed" if args.recompute_vision else "")
    )


def _saved_args(args: argparse.Namespace) -> dict:
    """The run's arguments, minus what differs between ranks or is not an argument."""
    return {k: v for k, v in vars(args).items() if k not in ("rank", "coreset")}


def log_line(
    it: int,
    total: int,
    consumed: int,
    ms: float,
    lr: float,
    gbs: int,
    loss: float,
    grad_norm: float,
    skipped: int = 0,
    nan: int = 0,
    loss_scale: float | None = None,
) -> str:
    """Megatron's iteration line; `skipped` / `nan`: iterations since the last line whose step
    was not applied (non-finite gradient norm, fp16 overflow) / whose loss was NaN or Inf;
    `loss_scale`: fp16's current loss scale."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    scale = f"loss scale: {loss_scale:.1f} | " if loss_scale is not None else ""
    return (
        f" [{now}] iteration {it:8d}/{total:8d} | consumed samples: {consumed:12d} | "
        f"elapsed time per iteration (ms): {ms:.1f} | learning rate: {lr:.6E} | "
        f"global batch size: {gbs:5d} | lm loss: {loss:.6E} | {scale}"
        f"grad norm: {grad_norm:.3f} | "
        f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |"
    )


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    from megatron_mllm.training.arguments import parse_args

    args = parse_args(argv)
    cfg = model_config(args)
    plan = ParallelPlan(
        args.data_parallel_size,
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
    )
    n_mb = args.global_batch_size // (args.micro_batch_size * plan.dp)
    from megatron_mllm.runtime.schedules import runtime_plan

    forced = None
    if args.encoder_tensor_model_parallel_size:
        forced = colocated_encoder_plan(
            plan, args.encoder_tensor_model_parallel_size, args.encoder_pipeline_model_parallel_size
        )
    if args.dry_run:
        print(dry_run_summary(args, cfg, plan, forced, n_mb))
        return 0
    schedule, workload = runtime_plan(
        cfg,
        plan,
        args.micro_batch_size,
        n_mb,
        args.bubble_schedule,
        encoder_plan=forced,
        frozen_encoder=args.freeze_ViT,
        unit=args.fill_granularity if args.bubble_schedule == "optimus" else "layer",
        sequence_parallel=args.sequence_parallel,
        recompute=recompute_of(args),
    )
    layers = schedule.meta.backbone_layers
    if plan.vpp > 1 and len(set(layers)) > 1:
        raise ConfigError(
            f"the planned backbone split {list(layers)} is uneven, which an interleaved "
            "backbone cannot run; use --bubble-schedule megatron"
        )
    from megatron_mllm.schedule.simulator import simulate

    predicted = simulate(schedule, workload)
    pool_schedule = None
    if args.coreset is not None:
        from megatron_mllm.runtime.job import encoder_plan_of
        from megatron_mllm.runtime.schedules import runtime_schedule

        enc_plan, stage0 = encoder_plan_of(schedule, plan)
        pool_mbs = args.coreset.pool_size // args.micro_batch_size
        pool_schedule = runtime_schedule(
            cfg,
            plan,
            args.micro_batch_size,
            pool_mbs,
            "megatron" if stage0 else "optimus",
            encoder_plan=None if stage0 else enc_plan,
            frozen_encoder=args.freeze_ViT,
            unit="layer" if stage0 else args.fill_granularity,
        )
    return _train(args, cfg, plan, n_mb, schedule, pool_schedule, predicted)


def recompute_of(args) -> Recompute:
    """The recomputation the --recompute-* arguments ask for."""
    return Recompute(
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
        args.recompute_vision,
    )


def runtime_job(args, cfg, plan, n_mb, schedule, pool_schedule, state, units):
    """The RuntimeJob that pretrain_mllm.py's arguments describe."""
    from megatron_mllm.runtime.job import (
        Collect,
        DataParts,
        ExecutorSettings,
        ModelParts,
        OptimizerSettings,
        PlanParts,
        RuntimeJob,
    )

    return RuntimeJob(
        ModelParts(
            cfg,
            state,
            frozen_encoder=args.freeze_ViT,
            precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            recompute=recompute_of(args),
            transformer_impl=args.transformer_impl,
        ),
        PlanParts(
            plan, schedule=schedule, encoder_units=units, sequence_parallel=args.sequence_parallel
        ),
        DataParts(
            args.micro_batch_size,
            n_mb,
            seed=args.seed,
            coreset=args.coreset,
            pool_schedule=pool_schedule,
            data_path=args.data_path,
        ),
        optimizer=OptimizerSettings(
            lr=args.lr,
            clip_grad=args.clip_grad,
            min_lr=args.min_lr,
            overlap_grad_reduce=args.overlap_grad_reduce,
            distributed=args.use_distributed_optimizer,
            ddp_bucket_size=args.ddp_bucket_size,
            overlap_param_gather=args.overlap_param_gather,
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            initial_loss_scale=args.initial_loss_scale,
        ),
        collect=Collect(grads=False),
        executor=ExecutorSettings(overlap_tp_fills=args.overlap_tp_fills),
        timeout_s=args.distributed_timeout_minutes * 60,
    )


def _train(args, cfg, plan, n_mb, schedule, pool_schedule, predicted) -> int:
    import torch.distributed as dist

    from megatron_mllm.runtime.bootstrap import init_rank
    from megatron_mllm.runtime.executor_run import ExecutorRun
    from megatron_mllm.runtime.job import encoder_plan_of
    from megatron_mllm.training import checkpointing

    rank, world = args.rank, args.world_size
    device = init_rank(rank, world, args.seed, args.distributed_timeout_minutes * 60)
    from megatron_mllm.parallel.groups import build_colocated_groups

    enc_plan, stage0 = encoder_plan_of(schedule, plan)
    units = "layer" if stage0 else args.fill_granularity
    probe = build_colocated_groups(plan, plan if stage0 else enc_plan, world, rank)
    state = initial_weights(cfg, probe)
    full_shapes = {k: tuple(v.shape) for k, v in state.items()}
    job = runtime_job(args, cfg, plan, n_mb, schedule, pool_schedule, state, units)
    run = ExecutorRun(rank, world, job, device)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = args.lr_decay_iters or args.train_iters
    scheduler = OptimizerParamScheduler(
        run.optimizer,
        0.0,
        args.lr,
        args.min_lr,
        args.lr_warmup_iters,
        decay,
        args.lr_decay_style,
        args.weight_decay,
        args.weight_decay,
        decay,
        "constant",
    )
    from megatron_mllm.runtime.optimizer import grad_scaler_state, load_grad_scaler_state

    grad_scaler = run.grad_scaler
    c = run.groups.coords
    enc_tp = c.tp if run.stage0 else c.enc_tp
    enc_replica = (
        c.dp if run.stage0 else (c.enc_slot + run.groups.slots * (c.dp + plan.dp * c.enc_row))
    )
    parts = [(chunk, c.tp, plan.tp, c.dp) for chunk in run.chunks]
    parts += [(encoder, enc_tp, run.enc_tp, enc_replica) for encoder in run.encoders]
    # The coreset selector (last stage, TP rank 0 of each replica) is checkpointed per replica.
    holds_selector = run.selector is not None and run.backbone.post_process and c.tp == 0

    def per_rank_objects(selector=None, rng=None) -> dict:
        out = {"rng_state": (rng, rank, world)}  # megatron saves RNG per rank, too
        if holds_selector:
            out["coreset_selector"] = (selector, c.dp, plan.dp)
        return out

    def save_checkpoint(iteration: int) -> None:
        common = {
            "iteration": iteration,
            "scheduler": scheduler.state_dict(),
            "grad_scaler": grad_scaler_state(grad_scaler) if grad_scaler is not None else None,
            "consumed_samples": iteration * args.global_batch_size,
            "args": _saved_args(args),
        }
        selector = run.selector.state_dict() if holds_selector else None
        checkpointing.save(
            args.save,
            iteration,
            parts,
            full_shapes,
            run.optimizer,
            common,
            per_rank_objects(selector, checkpointing.capture_rng_state()),
        )

    start = 0
    if args.load:
        saved = checkpointing.read_common(args.load)
        objects = per_rank_objects()
        same_layout = all(
            saved.get("args", {}).get(k) == getattr(args, k)
            for k in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")
        )
        if not same_layout:  # resharded: RNG streams belong to ranks that no longer exist
            objects.pop("rng_state")
        common = checkpointing.load(args.load, parts, full_shapes, run.optimizer, objects)
        if saved.get("model_only"):
            what = "model weights only (no optimizer, scheduler or RNG state)"
        else:
            if holds_selector:
                run.selector.load_state_dict(common["objects"]["coreset_selector"])
            if "rng_state" in common["objects"]:
                checkpointing.restore_rng_state(common["objects"]["rng_state"])
            start = common["iteration"]
            scheduler.load_state_dict(common["scheduler"])
            if grad_scaler is not None and common.get("grad_scaler") is not None:
                load_grad_scaler_state(grad_scaler, common["grad_scaler"])  # fp16: the loss scale
            what = "iteration " + str(start) + ("" if same_layout else ", resharded; fresh RNG")
        if rank == 0:
            print(f" loaded checkpoint from {args.load}: {what}", flush=True)
    if rank == 0:
        print(startup_summary(args, plan, enc_plan, stage0, n_mb, predicted), flush=True)
    writer = None
    if args.tensorboard_dir and rank == world - 1:  # Megatron writes from the last rank
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.log_interval)
    skipped = nan = 0  # since the last log line, as Megatron counts them
    for it in range(start, args.train_iters):
        t0, before = time.perf_counter(), run.skipped_iterations
        run.step(it)
        lr = run.optimizer.param_groups[0]["lr"]
        applied = run.skipped_iterations == before
        if applied:  # Megatron advances the schedule only for applied steps
            scheduler.step(1)
        mean = mean_loss(run.history[-1], device)  # reads the step's results: ends it
        ms = 1000 * (time.perf_counter() - t0)
        skipped, nan = skipped + (not applied), nan + (not math.isfinite(mean))
        if rank == 0 and ((it + 1) % args.log_interval == 0 or it + 1 == args.train_iters):
            # Coreset: every sample of the pool counts as consumed.
            ratio = args.coreset.pool_ratio if args.coreset is not None else 1
            consumed = int((it + 1) * args.global_batch_size * ratio)
            print(
                log_line(
                    it + 1,
                    args.train_iters,
                    consumed,
                    ms,
                    lr,
                    args.global_batch_size,
                    mean,
                    run.last_grad_norm,
                    skipped,
                    nan,
                    run.loss_scale,
                ),
                flush=True,
            )
        if (it + 1) % args.log_interval == 0:
            skipped = nan = 0
        if writer is not None:
            step_samples = (it + 1) * args.global_batch_size
            for name, value in (
                ("lm loss", mean),
                ("learning-rate", lr),
                ("grad-norm", run.last_grad_norm),
                ("iteration-time", ms / 1000),
            ):
                writer.add_scalar(name, value, it + 1)
            writer.add_scalar("lm loss vs samples", mean, step_samples)
        if args.replan_after_iters == it + 1:
            replanned = run.replan()
            if rank == 0:
                from megatron_mllm.schedule.simulator import simulate

                if replanned:
                    new = simulate(*run.replanned[:2])
                    print(
                        f" > re-planned from measured unit times: predicted step "
                        f"{1000 * new.step_time_s:.1f} ms, bubble ratio {new.bubble_ratio:.1%}",
                        flush=True,
                    )
                else:
                    print(" > re-planning kept the current plan", flush=True)
        if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
            save_checkpoint(it + 1)
    if args.save and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args.train_iters)
    if args.trace:
        from megatron_mllm.schedule.trace import MeasuredTimeline, chrome_trace_events, write_png

        gathered = [None] * world
        dist.all_gather_object(gathered, run.spans)
        if rank == 0:
            spans = [s for rank_spans in gathered for s in rank_spans]
            os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
            with open(args.trace, "w") as f:
                json.dump(
                    {
                        "traceEvents": chrome_trace_events(spans, "measured"),
                        "displayTimeUnit": "ms",
                    },
                    f,
                )
            png = os.path.splitext(args.trace)[0] + ".png"
            write_png(
                {
                    f"measured step {args.train_iters} ({args.bubble_schedule})": MeasuredTimeline(
                        spans
                    )
                },
                png,
            )
            print(f" wrote {args.trace} and {png}", flush=True)
    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
