"""Every rule the command line must follow, checked in one pass (`validate_args`) before any
process group, file or checkpoint is touched: each refusal one line naming what is wrong and
what would be right."""

from __future__ import annotations

import argparse
import sys

from megatron_mllm.errors import ConfigError, flag
from megatron_mllm.schedule.choice import ScheduleChoice
from megatron_mllm.training.data_checks import check_data, check_native, check_packing

# What --use-checkpoint-args takes from a checkpoint (and a resume checks against it).
MODEL_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "seq_length",
    "encoder_num_layers",
    "encoder_hidden_size",
    "encoder_num_attention_heads",
    "img_h",
    "patch_dim",
    "num_channels",
    "ffn_hidden_size",
    "encoder_ffn_hidden_size",
    "encoder_arch",
    "encoder_activation",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "disable_bias_linear",
    "group_query_attention",
    "num_query_groups",
    "rotary_base",
    "disable_projector_bias",
    "extra_encoder",
    "add_qkv_bias",
    "mrope_section",
    "spatial_merge_size",
    "temporal_patch_size",
    "encoder_window_size",
    "encoder_full_attention_layers",
)


# --extra-encoder keys: the first encoder's flags without "--encoder-" (img-h, patch-dim as is).
ENCODER_SPEC_KEYS = {
    "num-layers": int,
    "hidden-size": int,
    "num-attention-heads": int,
    "ffn-hidden-size": int,
    "img-h": int,
    "patch-dim": int,
    "arch": ("vit", "clip"),
    "activation": ("gelu", "quick_gelu"),
}
REQUIRED_ENCODER_SPEC_KEYS = ("num-layers", "hidden-size", "num-attention-heads")


def parse_encoder_spec(spec: str) -> dict[str, int | str]:
    """One --extra-encoder value as {key: value}; a ConfigError line for anything malformed."""
    out: dict[str, int | str] = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        kind = ENCODER_SPEC_KEYS.get(key)
        if not sep or kind is None:
            raise ConfigError(
                f"--extra-encoder {spec!r}: '{item}' is not key=value with a key among "
                f"{', '.join(ENCODER_SPEC_KEYS)}"
            )
        if kind is int:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--extra-encoder {spec!r}: {key} must be a positive integer")
            out[key] = int(value)
        elif value not in kind:
            raise ConfigError(f"--extra-encoder {spec!r}: {key} must be one of {', '.join(kind)}")
        else:
            out[key] = value
    missing = [k for k in REQUIRED_ENCODER_SPEC_KEYS if k not in out]
    if missing:
        raise ConfigError(f"--extra-encoder {spec!r}: give {', '.join(missing)}")
    return out


# Arguments that define the model (saved in every checkpoint; see --use-checkpoint-args).
def _check_precision_and_recompute(args: argparse.Namespace) -> None:
    """Precision, optimizer and recomputation flags that cannot go together (Megatron's
    rules), one line each."""
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 both given; choose one precision")
    if (args.bf16 or args.fp16) and not args.use_distributed_optimizer:
        half = "--bf16" if args.bf16 else "--fp16"
        raise ConfigError(
            f"{half} keeps its fp32 main parameters in the distributed optimizer for now; add "
            "--use-distributed-optimizer"
        )
    if not args.initial_loss_scale > 0 or args.initial_loss_scale == float("inf"):
        raise ConfigError(
            f"--initial-loss-scale {args.initial_loss_scale}: give a positive finite number"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError(
            "--overlap-param-gather needs --use-distributed-optimizer (without it parameters "
            "are not sharded, so there is nothing to gather)"
        )
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ConfigError(
            f"--use-distributed-optimizer shards Adam's state only; --optimizer {args.optimizer} "
            "cannot be sharded: use --optimizer adam or drop --use-distributed-optimizer"
        )
    if args.optimizer != "adam":
        raise ConfigError(
            f"--optimizer {args.optimizer} is not supported yet (its state is not in our "
            "checkpoints); use --optimizer adam"
        )
    full = args.recompute_granularity == "full"
    if args.recompute_method is not None and not full:
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    if args.recompute_num_layers is not None and not full:
        raise ConfigError("--recompute-num-layers needs --recompute-granularity full")
    if full and (args.recompute_method is None or (args.recompute_num_layers or 0) < 1):
        raise ConfigError(
            "--recompute-granularity full needs --recompute-method uniform|block and "
            "--recompute-num-layers N >= 1"
        )
    if args.recompute_vision and args.fill_granularity == "kernel":
        raise ConfigError(
            "--recompute-vision recomputes whole encoder layers; kernel-sized units keep what "
            "their backward needs: use --fill-granularity layer"
        )
    if args.transformer_impl == "transformer_engine":
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "--transformer-impl transformer_engine: Transformer Engine is not installed "
                "here; install it or use --transformer-impl local"
            )
        if args.fill_granularity == "kernel":
            raise ConfigError(
                "--transformer-impl transformer_engine fuses the norm into the QKV GEMM; kernel "
                "units are cut from the local layers: use --fill-granularity layer"
            )


def _check_backbone_split(args: argparse.Namespace, pp: int) -> None:
    """--decoder-first/last-pipeline-num-layers -> args.backbone_split (layers per stage), or
    () when the schedule chooses; one line for a split megatron-core cannot build."""
    from megatron_mllm.schedule.partition import first_last_split

    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    args.backbone_split = ()
    if first is None and last is None:
        first_last_split(args.num_layers, pp)  # refuses only what cannot be split at all
        return
    for name, value in (("first", first), ("last", last)):
        if value is not None and not 1 <= value < args.num_layers:
            raise ConfigError(
                f"--decoder-{name}-pipeline-num-layers {value}: give 1 to {args.num_layers - 1}"
            )
    if pp == 1 or args.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(
            "--decoder-first/last-pipeline-num-layers need PP > 1 and no virtual pipeline "
            "(an interleaved backbone is split evenly)"
        )
    if args.bubble_schedule == "balanced":
        raise ConfigError(
            "--bubble-schedule balanced chooses its own uneven split; drop "
            "--decoder-first/last-pipeline-num-layers or use megatron or optimus"
        )
    args.backbone_split = tuple(first_last_split(args.num_layers, pp, first, last))


def _check_schedule_and_rates(args: argparse.Namespace) -> None:
    """Learning-rate schedule, rates and timeouts: finite, in range, a warm-up that ends."""
    import math

    def in_range(name: str, low: float, high: float = math.inf, below_high=False) -> None:
        value = getattr(args, name)
        fits = value < high if below_high else value <= high
        if math.isfinite(value) and low <= value and fits:
            return
        bound = "" if high == math.inf else f" and {'below' if below_high else 'at most'} {high}"
        raise ConfigError(f"{flag(name)} {value}: give a finite number of at least {low}{bound}")

    in_range("lr", 0.0)
    in_range("min_lr", 0.0, args.lr)
    in_range("weight_decay", 0.0)
    in_range("clip_grad", 0.0)
    in_range("hidden_dropout", 0.0, 1.0, below_high=True)
    in_range("attention_dropout", 0.0, 1.0, below_high=True)
    if not 0 < args.distributed_timeout_minutes < math.inf:
        raise ConfigError(
            f"--distributed-timeout-minutes {args.distributed_timeout_minutes}: give a "
            "positive number of minutes"
        )
    if args.lr_decay_iters is not None and args.lr_decay_iters < 1:
        raise ConfigError(f"--lr-decay-iters {args.lr_decay_iters}: give a positive count")
    decay = args.lr_decay_iters or args.train_iters
    if not 0 <= args.lr_warmup_iters < decay:
        source = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be at least 0 and below the LR "
            f"decay's {decay} iterations ({source})"
        )


def _check_plan_candidates(args) -> None:
    """--plan-candidates K: Optimus plans on our executor, each given its steps."""
    k = args.plan_candidates
    if k is None:
        return
    from megatron_mllm.training.plan_candidates import check_counts, most_steps

    check_counts(k, args.plan_candidate_steps, args.plan_candidate_layout_warmup)
    others = {
        "--bubble-schedule optimus-adaptive (it plans every step itself)": (
            ScheduleChoice(args.bubble_schedule).per_step
        ),
        "--coreset-pool-ratio (its pool schedule is built for one layout)": args.coreset,
        "--replan-after-iters (candidates are re-planned after warm-up)": (
            args.replan_after_iters is not None
        ),
        "--encoder-tensor-model-parallel-size (a forced encoder plan leaves nothing to try)": (
            args.encoder_tensor_model_parallel_size
        ),
    }
    _refuse_together("--plan-candidates", others)
    if args.bubble_schedule != ScheduleChoice.OPTIMUS:
        raise ConfigError(
            f"--plan-candidates tries Optimus plans; use --bubble-schedule optimus (got "
            f"{args.bubble_schedule})"
        )
    splits = bool(args.encoder_wgrad_split) + bool(args.backbone_wgrad_split)
    steps = most_steps(k, splits, args.plan_candidate_steps, args.plan_candidate_layout_warmup)
    if args.train_iters < steps:
        raise ConfigError(
            f"--train-iters {args.train_iters} ends inside the plan-candidate phase (up to "
            f"{steps} iterations for K={k}); train longer, lower --plan-candidates or give "
            "--plan-candidate-layout-warmup 0"
        )


def _check_lookahead(args: argparse.Namespace) -> None:
    """--coreset-lookahead needs a coreset (per-step plans are refused with any coreset, and a
    re-plan makes its merge again); without pipeline stages it
    has no bubbles to hide the pool in: accepted with a warning (selection one step old). Its
    order defaults to the simulated one."""
    if not args.coreset_lookahead:
        if args.coreset_lookahead_order is not None:
            raise ConfigError(
                f"--coreset-lookahead-order {args.coreset_lookahead_order} orders the "
                "look-ahead's pool; add --coreset-lookahead"
            )
        return
    args.coreset_lookahead_order = args.coreset_lookahead_order or "simulated"
    if args.coreset is None:
        raise ConfigError("--coreset-lookahead needs --coreset-pool-ratio R (a coreset to select)")
    if args.pipeline_model_parallel_size == 1 and args.rank == 0:
        print(
            "WARNING: --coreset-lookahead at --pipeline-model-parallel-size 1: no pipeline "
            "bubbles to hide the next pool's forward in; it runs after the step's own work "
            "(selection one step old, no time saved)",
            file=sys.stderr,
        )


def _check_wgrad_split(args: argparse.Namespace) -> None:
    """--encoder-wgrad-split: one static Optimus plan on megatron-core's local linears."""
    if not args.encoder_wgrad_split:
        return
    others = {
        f"--bubble-schedule {args.bubble_schedule} (use optimus)": (
            args.bubble_schedule != ScheduleChoice.OPTIMUS
        ),
        **_split_refusals(args),
    }
    _refuse_together("--encoder-wgrad-split", others)


def _split_refusals(args: argparse.Namespace) -> dict[str, object]:
    """What either split backward (encoder or backbone) does not run with."""
    return {
        "--transformer-impl transformer_engine (its fused linears keep no weight products)": (
            args.transformer_impl != "local"
        ),
        "--coreset-lookahead (its merged schedule is built without the split)": (
            args.coreset_lookahead
        ),
    }


def _check_backbone_wgrad_split(args: argparse.Namespace) -> None:
    """--backbone-wgrad-split: one static plan (Optimus or the Megatron schedule on our
    executor) on megatron-core's local linears, without sequence parallelism, on a pipeline
    without virtual stages."""
    if not args.backbone_wgrad_split:
        return
    if args.pipeline_model_parallel_size < 2:
        raise ConfigError(
            "--backbone-wgrad-split splits the backward a pipeline peer waits for; use "
            "--pipeline-model-parallel-size 2 or more"
        )
    if args.tensor_model_parallel_size > 1:
        raise ConfigError(
            "--backbone-wgrad-split runs at --tensor-model-parallel-size 1 (its deferred "
            f"linears' all-reduce would not host TP-bubble fills); got "
            f"{args.tensor_model_parallel_size}"
        )
    others = {
        "--bubble-schedule optimus-adaptive (its per-step plans are made without the split)": (
            args.bubble_schedule == ScheduleChoice.OPTIMUS_ADAPTIVE
        ),
        "--recompute-granularity full (the deferred products would hold what it frees)": (
            args.recompute_granularity == "full"
        ),
        "--num-layers-per-virtual-pipeline-stage (1F1B without virtual stages only)": (
            args.num_layers_per_virtual_pipeline_stage is not None
        ),
        **_split_refusals(args),
    }
    _refuse_together("--backbone-wgrad-split", others)


def _refuse_together(flag: str, others: dict[str, object]) -> None:
    """One line for the first of `others` (what -> whether it is given) given with `flag`."""
    for what, given in others.items():
        if given:
            raise ConfigError(f"{flag} does not run with {what}; drop one of the two")


def validate_args(args: argparse.Namespace) -> None:
    """Every combination that cannot work, as one line, before any group or file is touched."""
    tp, pp, world = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.world_size,
    )
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "log_interval",
        "max_skipped_iterations",
    ):
        if getattr(args, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} is {getattr(args, name)}; it must be "
                "a positive integer"
            )
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} is not divisible by TP {tp} x PP {pp}; start "
            f"a multiple of {tp * pp} processes"
        )
    for spec in args.extra_encoder:
        parse_encoder_spec(spec)
    _check_precision_and_recompute(args)
    _check_schedule_and_rates(args)
    from megatron_mllm.runtime.assembly.device_env import device_connections_problem

    connections = device_connections_problem()
    if connections is not None:
        raise ConfigError(connections)
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size {args.ddp_bucket_size}: give a positive count")
    dp = world // (tp * pp)
    args.data_parallel_size = dp
    if args.sequence_parallel and tp == 1:  # Megatron's rule: a warning, not an error
        if args.rank == 0:
            print(
                "WARNING: Disabling sequence parallelism because tensor model parallelism is "
                "disabled",
                file=sys.stderr,
            )
        args.sequence_parallel = False
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size x DP = {args.micro_batch_size * dp}"
        )
    if args.num_layers < pp:
        raise ConfigError(f"--num-layers {args.num_layers} is fewer than PP {pp} stages")
    _check_backbone_split(args, pp)
    _check_virtual_stages(args, pp)
    _check_encoder_plan(args, tp, pp)
    _check_coreset(args, dp)
    check_packing(args)
    check_native(args)
    check_data(args)
    per_step = ScheduleChoice(args.bubble_schedule).per_step
    if per_step and (args.coreset is not None or args.replan_after_iters is not None):
        raise ConfigError(
            "--bubble-schedule optimus-adaptive plans each step for its data; it does not run "
            "with --coreset-pool-ratio or --replan-after-iters (use --bubble-schedule optimus)"
        )
    _check_wgrad_split(args)
    _check_backbone_wgrad_split(args)
    _check_lookahead(args)
    _check_plan_candidates(args)
    if args.replan_after_iters is not None:
        if args.replan_after_iters < 1 or args.bubble_schedule != ScheduleChoice.OPTIMUS:
            raise ConfigError(
                "--replan-after-iters N needs N >= 1 and --bubble-schedule optimus "
                f"(got {args.replan_after_iters}, {args.bubble_schedule})"
            )
    if not 0 <= args.max_param_norm_growth < float("inf"):  # NaN fails too
        raise ConfigError(
            f"--max-param-norm-growth {args.max_param_norm_growth}: give a factor >= 1, or 0 to "
            "turn the check off"
        )
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    from megatron_mllm.training.resume_contract import check_resume, check_save

    check_resume(args, MODEL_ARGS)
    check_save(args)


def _check_virtual_stages(args: argparse.Namespace, pp: int) -> None:
    """--num-layers-per-virtual-pipeline-stage: the VPP size it gives (1 without it)."""
    args.virtual_pipeline_model_parallel_size = 1
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        if pp == 1:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )
        if per_chunk < 1 or args.num_layers % (pp * per_chunk):
            raise ConfigError(
                f"--num-layers {args.num_layers} does not split into PP {pp} stages of chunks "
                f"of {per_chunk} layers (--num-layers-per-virtual-pipeline-stage)"
            )
        if args.bubble_schedule == "balanced":
            raise ConfigError(
                "--bubble-schedule balanced moves layers off stage 0, which an interleaved "
                "backbone cannot; use megatron or optimus with "
                "--num-layers-per-virtual-pipeline-stage"
            )
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * per_chunk)


def _check_encoder_plan(args: argparse.Namespace, tp: int, pp: int) -> None:
    """A forced encoder plan: both of its sizes, dividing the backbone's."""
    etp, epp = args.encoder_tensor_model_parallel_size, args.encoder_pipeline_model_parallel_size
    if (etp is None) != (epp is None):
        raise ConfigError(
            "give both --encoder-tensor-model-parallel-size and "
            "--encoder-pipeline-model-parallel-size, or neither"
        )
    if etp is not None:
        if not ScheduleChoice(args.bubble_schedule).is_optimus:
            raise ConfigError("an encoder plan needs --bubble-schedule optimus or optimus-adaptive")
        if tp % etp or pp % epp:
            raise ConfigError(f"encoder TP {etp} / PP {epp} must divide backbone TP {tp} / PP {pp}")
        if args.encoder_num_layers % epp:
            raise ConfigError(
                f"--encoder-num-layers {args.encoder_num_layers} does not split "
                f"over encoder PP {epp}"
            )


def _check_coreset(args: argparse.Namespace, dp: int) -> None:
    """--coreset-pool-ratio: the CoresetConfig it gives (None without it)."""
    if args.coreset_pool_ratio is not None:
        from megatron_mllm.data.coreset import CoresetConfig

        b = args.global_batch_size // dp
        args.coreset = CoresetConfig(
            batch_size=b,
            pool_ratio=args.coreset_pool_ratio,
            features=args.coreset_features,
            num_directions=args.coreset_directions,
            seed=args.seed,
        )
        if args.coreset.pool_size % args.micro_batch_size:
            raise ConfigError(
                f"coreset pool of {args.coreset.pool_size} is not a multiple of "
                f"--micro-batch-size {args.micro_batch_size}"
            )
    else:
        args.coreset = None
