"""What a training run prints, in Megatron's words: the start-up summary, the --dry-run
summary, the iteration line and the validation lines, and the step's mean loss they report."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from megatron_mllm.schedule.schedule import LookaheadTimes, Schedule
from megatron_mllm.upstream_warnings import fallbacks

if TYPE_CHECKING:
    from megatron_mllm.training.run_config import RunConfig


def startup_summary(run: RunConfig, enc_plan, stage0: bool, p, schedule: Schedule) -> str:
    """Both plans (the backbone's layers per virtual stage as `schedule` built them) and the
    predicted bubble ratio (`p`, the simulator's result) for the run's encoder load."""
    args, plan, layers = run.args, run.plan, schedule.meta.backbone_layers
    where = "whole, on backbone stage 0" if stage0 else "colocated on every backbone stage"
    if args.extra_encoder:
        where = f"{1 + len(args.extra_encoder)} encoders, each " + where
    if args.freeze_ViT:
        where += "; frozen: forward only, its projector trains"
    if args.encoder_wgrad_split:  # the planner keeps the split only where it predicts a gain
        kept = "backward split" if schedule.meta.splits_weight_grads else None
        where += _split_note(args, kept, "the split backward", SPLIT_FLAGS["wgrad_split"], "")
    bb_split = ""
    if args.backbone_wgrad_split:
        points = schedule.meta.backbone_wgrad
        kept = f"backward split at {len(points)} (stage, micro-batch) points" if points else None
        why = ", or the plan cannot split: the encoder on stage 0, or its TP not 1"
        bb_split = _split_note(
            args, kept, "the split backbone backward", SPLIT_FLAGS["backbone_wgrad_split"], why
        )
    return "\n".join(
        [
            f" > backbone plan: {plan} (world size {plan.world_size})"
            + (", sequence parallel" if args.sequence_parallel else "")
            + (f"; layers per stage {list(layers)}" if layers else "")
            + bb_split,
            f" > encoder plan:  {enc_plan} ({where})",
            f" > schedule: {run.schedule}; {run.num_microbatches} micro-batches of "
            f"{run.micro_batch} per step and DP replica, planned for "
            f"{run.images_per_sample:.2f} {_load_unit(run)} per sample" + _adaptive_note(run),
            " > " + training_summary(args),
            *_packing_line(run),
            f" > optional libraries: {fallbacks()}",
            f" > predicted by the analytic CPU cost model (uncalibrated): step "
            f"{1000 * p.step_time_s:.1f} ms, bubble ratio "
            f"{p.bubble_ratio:.1%}, zero-bubble limit {1000 * p.limit_s:.1f} ms",
        ]
    )


def _load_unit(run: RunConfig) -> str:
    """What the planned encoder load counts: images, or a native tower's nominal images (each
    image weighed by its cost at its own size)."""
    if not run.model.vit_native:
        return "images"
    side = run.model.image_size
    return f"nominal {side}x{side} images (by patches)"


def _packing_line(run: RunConfig) -> list[str]:
    size = run.args.packing_buffer_size
    if size is None:
        return []
    return [
        f" > packed: each training row of {run.args.seq_length} tokens holds the conversations "
        f"that fit, from buffers of {size} samples (first fit, longest first), attention and "
        "positions within each"
    ]


def _adaptive_note(run: RunConfig) -> str:
    if not run.schedule.per_step:
        return ""
    if run.deals_samples:
        return "; each step re-planned for its own, its samples dealt by encoder load"
    return "; each step re-planned for its own (its micro-batches keep their samples)"


def lookahead_line(times: LookaheadTimes, order: str) -> str:
    """The start-up line of --coreset-lookahead: what merging the next pool's forward into
    the step (`order`: --coreset-lookahead-order) is predicted to save."""
    alone, merged = times.step_alone_s + times.pool_alone_s, times.step_s
    return (
        f" > coreset look-ahead: the next pool's forward in this step's bubbles ({order}), "
        "predicted "
        f"{1000 * merged:.1f} ms a step against {1000 * alone:.1f} ms for the pool pass then "
        f"the step ({times.saving:.2f}x; the cost model above)"
    )


def dry_run_summary(run: RunConfig) -> str:
    """What --dry-run prints: the checked job, without planning or touching anything."""
    args, cfg, plan = run.args, run.model, run.plan
    vit, llm = cfg.num_params()
    forced = run.encoder_plan
    enc = f"{forced} (given)" if forced else "chosen by the planner at start-up"
    return "\n".join(
        [
            " > arguments checked for world size {} ({})".format(
                plan.world_size, "dry run: nothing started"
            ),
            f" > backbone plan: {plan}{', sequence parallel' if args.sequence_parallel else ''}; "
            f"encoder plan: {enc}; schedule {run.schedule}",
            f" > encoder: {cfg.vit_layers} layers x {cfg.vit_hidden} ({vit / 1e9:.2f}B "
            f"params, all encoders), {_image_tokens(cfg)}"
            + (f"; {cfg.num_encoders - 1} more encoder(s)" if cfg.num_encoders > 1 else ""),
            f" > backbone: {cfg.llm_layers} layers x {cfg.llm_hidden} ({llm / 1e9:.2f}B "
            f"params), {cfg.seq_len} tokens per sample",
            f" > {run.num_microbatches} micro-batches of {run.micro_batch} per step and DP "
            f"replica, planned for {run.images_per_sample:.2f} {_load_unit(run)} per sample",
            " > " + training_summary(args),
        ]
    )


def _image_tokens(cfg) -> str:
    if cfg.vit_native:
        windows = ""
        if cfg.vit_window:
            full = " ".join(map(str, cfg.vit_full_layers)) or "none"
            windows = f"; attention in {cfg.vit_window}-pixel windows but layers {full}"
        return (
            f"native resolution: each image at its own size, up to {cfg.encoder_seq_len} patches "
            f"and {cfg.image_tokens} backbone tokens at --img-h {cfg.image_size}{windows}"
        )
    return f"{cfg.encoder_seq_len} tokens per image"


# ScheduleMeta.split_options()' names -> the flag that asks for the split
SPLIT_FLAGS = {
    "wgrad_split": "--encoder-wgrad-split",
    "backbone_wgrad_split": "--backbone-wgrad-split",
}


def replan_line(replanned: tuple | None) -> str:
    """The re-plan's line: the new schedule's predicted step and bubbles and the splits it
    kept (`replanned`: (schedule, workload, ...)), or that the current plan stays (None)."""
    if replanned is None:
        return " > re-planning kept the current plan"
    from megatron_mllm.schedule.simulator import simulate

    schedule, workload = replanned[:2]
    new = simulate(schedule, workload)
    splits = [SPLIT_FLAGS[name] for name, on in schedule.meta.split_options().items() if on]
    kept = f"; {' and '.join(splits)} kept" if splits else ""
    return (
        f" > re-planned from measured unit times: predicted step {1000 * new.step_time_s:.1f}"
        f" ms, bubble ratio {new.bubble_ratio:.1%}{kept}"
    )


def _split_note(args, kept: str | None, what: str, flag: str, why: str) -> str:
    """The start-up line's word on a split backward: kept, among the plan candidates, or not
    kept (and `why`, beyond a prediction of no gain)."""
    if kept:
        return f"; {kept}, weight gradients in later bubbles"
    if args.plan_candidates:
        return f"; {what} among the plan candidates"
    return f"; {flag} not kept (predicted no faster{why})"


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
        + ("; per-token loss" if getattr(args, "calculate_per_token_loss", False) else "")
    )


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
    truncated: tuple[int, ...] | None = None,
    packed: bool = False,
) -> str:
    """Megatron's iteration line; `skipped` / `nan`: iterations since the last line whose step
    was not applied (non-finite gradient norm, fp16 overflow) / whose loss was NaN or Inf;
    `loss_scale`: fp16's current loss scale; `truncated`: conversation data's samples cut to
    --seq-length so far, those of them left without an answer token, samples skipped as
    corrupted and samples read; `packed`: rows hold several samples (their count is shown)."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    scale = f"loss scale: {loss_scale:.1f} | " if loss_scale is not None else ""
    return (
        f" [{now}] iteration {it:8d}/{total:8d} | consumed samples: {consumed:12d} | "
        f"elapsed time per iteration (ms): {ms:.1f} | learning rate: {lr:.6E} | "
        f"global batch size: {gbs:5d} | lm loss: {loss:.6E} | {scale}"
        f"grad norm: {grad_norm:.3f} | "
        f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |"
        + (
            f" truncated samples: {truncated[0]} (no answer left: {truncated[1]}) |"
            f" corrupted samples skipped: {truncated[2]} |"
            if truncated is not None
            else ""
        )
        + (f" packed samples: {truncated[3]} |" if packed and truncated is not None else "")
    )


def validation_lines(
    iteration: int, loss: float, accuracy: float, answered: int, final: bool = False
) -> str:
    """Megatron's validation report between dashed lines, with the exact-match accuracy of
    the assistant turns (`answered` samples)."""
    import math

    where = "the end of training for val data" if final else f"iteration {iteration}"
    ppl = math.exp(min(20.0, loss))
    text = (
        f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        f"answer exact match: {accuracy:.4f} ({answered} samples) |"
    )
    dashes = "-" * len(text)
    return f"{dashes}\n{text}\n{dashes}"
