"""Megatron-style command-line arguments for pretrain_mllm.py, checked before anything starts."""

from __future__ import annotations

import argparse
import os
import sys

from megatron_mllm.errors import ConfigError, flag


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Train a multimodal LLM (ViT + projector + GPT) on megatron-core.")
    g = p.add_argument_group("parallelism (Megatron names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved pipeline: backbone layers per model chunk",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the backbone's activations over the TP group between its TP regions "
        "(ignored, with a warning, at TP 1, as in Megatron)",
    )
    g = p.add_argument_group("encoder plan and schedule (ours)")
    g.add_argument(
        "--encoder-tensor-model-parallel-size",
        type=int,
        default=None,
        help="with --encoder-pipeline-model-parallel-size: force the encoder plan "
        "(default: the planner chooses)",
    )
    g.add_argument("--encoder-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument(
        "--bubble-schedule",
        choices=["megatron", "balanced", "optimus", "optimus-adaptive"],
        default="optimus",
        help="megatron: encoder in stage 0, 1F1B, even split; balanced: the same with "
        "fewer backbone layers on stage 0; optimus: encoder in the bubbles; "
        "optimus-adaptive: optimus with each step planned for its own images, one step ahead",
    )
    g.add_argument(
        "--coreset-pool-ratio",
        type=float,
        default=None,
        help="train on B samples chosen from a pool of ratio x B (off by default)",
    )
    g.add_argument(
        "--freeze-ViT",
        action="store_true",
        help="Megatron's multimodal flag: the encoder runs forward only, its projector trains",
    )
    g.add_argument(
        "--fill-granularity",
        choices=["layer", "kernel"],
        default="layer",
        help="encoder work placed into bubbles as whole layers or as kernels "
        "(norm, QKV, attention, projection, MLP pieces)",
    )
    g.add_argument(
        "--overlap-tp-fills",
        action="store_true",
        help="optimus: run encoder work placed into a TP bubble while the backbone's TP "
        "collectives (all-reduces; all-gathers and reduce-scatters with --sequence-parallel) "
        "are in flight (else just before the backbone action)",
    )
    g.add_argument(
        "--replan-after-iters",
        type=int,
        default=None,
        help="optimus: after N iterations, plan again from the unit times measured so far",
    )
    g.add_argument(
        "--plan-candidates",
        type=int,
        default=None,
        metavar="K",
        help="optimus: the planner's K best plans (one per encoder plan and placement) and the "
        "Megatron schedule each train --plan-candidate-steps real steps after warm-up "
        "(re-planned and predicted from the times this job measured first); the fastest "
        "measured trains on",
    )
    g.add_argument(
        "--plan-candidate-steps",
        type=int,
        default=3,
        help="with --plan-candidates: steps per candidate (the first warms it up)",
    )
    g.add_argument(
        "--coreset-lookahead",
        action="store_true",
        help="coreset: the next step's pool goes forward in this step's pipeline bubbles and is "
        "selected with this step's weights (one step old when it trains)",
    )
    g.add_argument("--coreset-features", choices=["zo", "exact"], default="zo")
    g.add_argument("--coreset-directions", type=int, default=16)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="backbone layers on the first pipeline stage (the others even); by default the "
        "schedule chooses",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="backbone layers on the last pipeline stage (the others even)",
    )
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument("--seq-length", type=int, default=16, help="text tokens per sample")
    g.add_argument("--encoder-num-layers", type=int, default=2)
    g.add_argument("--encoder-hidden-size", type=int, default=64)
    g.add_argument("--encoder-num-attention-heads", type=int, default=4)
    g.add_argument("--img-h", type=int, default=32, help="image size (square)")
    g.add_argument("--patch-dim", type=int, default=8)
    g.add_argument("--num-channels", type=int, default=3)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--encoder-ffn-hidden-size", type=int, default=None)
    g.add_argument(
        "--encoder-arch",
        choices=["vit", "clip"],
        default="vit",
        help="vit: patches + final norm; clip: LLaVA's CLIP tower (class token, pre-norm, "
        "quick_gelu, no final norm)",
    )
    g.add_argument(
        "--encoder-activation",
        choices=["gelu", "quick_gelu"],
        default=None,
        help="default: gelu for vit, quick_gelu for clip",
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU backbone MLP")
    g.add_argument("--disable-bias-linear", action="store_true", help="no backbone linear biases")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--disable-projector-bias", action="store_true")
    g.add_argument(
        "--extra-encoder",
        action="append",
        default=[],
        metavar="SPEC",
        help="another encoder (repeatable; its image tokens follow the first's): comma-separated "
        f"key=value of {', '.join(ENCODER_SPEC_KEYS)}, e.g. "
        "num-layers=1,hidden-size=32,num-attention-heads=2,img-h=16,patch-dim=4 "
        "(img-h and patch-dim default to the first encoder's)",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        default=None,
        help="a LLaVA-format energon dataset (tools/llava_to_energon.py); then --seq-length is "
        "the whole sequence, image tokens included; default: synthetic image-caption pairs",
    )
    g.add_argument("--tokenizer-type", choices=["HuggingFaceTokenizer"], default=None)
    g.add_argument("--tokenizer-model", default=None, help="a local Hugging Face tokenizer dir")
    g.add_argument("--image-token", default=None, help="the tokenizer's image token (<image>)")
    g.add_argument(
        "--loss-on-prompt", action="store_true", help="labels on every turn, not only answers"
    )
    g.add_argument("--num-workers", type=int, default=2, help="data-loader worker processes")
    g.add_argument(
        "--max-skipped-samples-fraction",
        type=float,
        default=0.01,
        help="start when damaged shards (cut short, missing; left out whole) hold at most this "
        "share of --data-path's samples, else refuse (default 0.01)",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--eval-interval", type=int, default=None, help="validate every N iterations")
    g.add_argument("--eval-iters", type=int, default=0, help="validation steps per validation")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="on resume, this run's LR-schedule arguments replace the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="on resume, the checkpoint's LR-schedule arguments replace this run's",
    )
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="every labelled token of the global batch weighs the same (Megatron's); with "
        "--bubble-schedule optimus-adaptive each replica's samples are then also dealt into "
        "micro-batches of equal image counts (without it only whole micro-batches move)",
    )
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="apply steps whose loss or gradient norm is NaN or Inf (by default they are "
        "skipped and counted, and --max-skipped-iterations of them in a row stop the run)",
    )
    g.add_argument(
        "--max-skipped-iterations",
        type=int,
        default=10,
        help="NaN or Inf steps in a row that stop the run (one line; the last checkpoint stays)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="megatron-core DDP: reduce each gradient bucket as soon as its last backward ran",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 parameters, activations and pipeline messages; fp32 main parameters in the "
        "distributed optimizer (needs --use-distributed-optimizer for now); the loss in fp32",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="megatron-core's DistributedOptimizer: optimizer state sharded over each part's DP "
        "group, gradients reduce-scattered; its checkpoints load with or without it, any DP",
    )
    g.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Adam (megatron-core's); sgd is refused for now (its momentum is not checkpointed)",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="distributed optimizer: each part's parameter all-gather starts at its AG action "
        "in the schedule and is waited for before its first forward",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="DDP gradient buffers and their reduction in fp32 (else in the parameter dtype)",
    )
    g.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 parameters and activations with megatron-core's dynamic loss scaling (one "
        "scale for both plans' optimizers); needs --use-distributed-optimizer",
    )
    g.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="fp16: the dynamic loss scale's first value (Megatron's default 2^32)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="backbone activation recomputation (megatron-core's, in its TransformerBlock)",
    )
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="full recomputation: layers per recomputed chunk (uniform) or per stage (block)",
    )
    g.add_argument(
        "--recompute-vision",
        action="store_true",
        help="recompute each encoder layer in backward (needs --fill-granularity layer)",
    )
    g.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="megatron-core's local layers (default), or Transformer Engine's where it imports",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="parameters per DDP gradient bucket (megatron-core's default when not given)",
    )
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument(
        "--max-param-norm-growth",
        type=float,
        default=100.0,
        help="a save is not taken where the parameters' norm grew more than this many times "
        "since the last save (finite but exploded weights); 0 turns the check off",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="Megatron's: on --exit-signal every rank finishes its iteration, saves and exits 0",
    )
    g.add_argument(
        "--exit-signal",
        default="SIGTERM",
        choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
        help="the signal --exit-signal-handler stops on (default SIGTERM, how clusters pre-empt)",
    )
    g.add_argument(
        "--allow-tokenizer-change",
        action="store_true",
        help="--load a checkpoint trained with another tokenizer (its embeddings then belong "
        "to other tokens)",
    )
    g.add_argument(
        "--allow-unverified-checkpoint",
        action="store_true",
        help="--load a checkpoint without a manifest even where other checkpoints of its run "
        "have one (its files are then not checked against sizes and checksums)",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="take the model arguments from the --load checkpoint (e.g. a converted LLaVA)",
    )
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=range(0, 3),
        help="1: under each iteration line, every rank's step broken down (compute, message "
        "waits, unhidden DP/TP communication, encoder fills, host overhead); 2: also each "
        "rank's longest waits by message",
    )
    g.add_argument(
        "--timing-log-option",
        default="minmax",
        choices=["max", "minmax", "all"],
        help="how --timing-log-level reports the ranks: the max, the min and max, or all",
    )
    g.add_argument(
        "--tensorboard-dir",
        default=None,
        help="write lm loss, learning rate, grad norm and iteration time scalars",
    )
    g.add_argument(
        "--trace",
        default=None,
        help="write the last step's real-execution trace (Chrome JSON) here",
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=2.0)
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="check the arguments for WORLD_SIZE ranks, print both plans and the model, exit "
        "(no process group, no file; e.g. to check a GPU recipe on a laptop)",
    )
    return p


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
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.use_checkpoint_args:
        if args.load is None:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        from megatron_mllm.training.checkpointing import read_common

        saved = read_common(args.load).get("args", {})
        for name in MODEL_ARGS:
            if name in saved:
                setattr(args, name, saved[name])
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    validate_args(args)
    return args


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


def _check_data(args: argparse.Namespace) -> None:
    """--data-path and its tokenizer, validation and loader arguments; with a tokenizer,
    --vocab-size becomes its size padded as Megatron pads it."""
    args.data_left_out, args.data_sources = [], []
    if not 0 <= args.max_skipped_samples_fraction < 1:  # NaN fails too
        raise ConfigError(
            f"--max-skipped-samples-fraction {args.max_skipped_samples_fraction}: give a "
            "fraction from 0 up to (not including) 1"
        )
    if args.data_path is None:
        if args.tokenizer_model or args.eval_iters:
            raise ConfigError(
                "--tokenizer-model and --eval-iters read conversation data: give --data-path"
            )
        return
    from megatron_mllm.data.energon_llava import (
        account_samples,
        check_energon_dataset,
        check_has_validation,
        validation_samples,
    )
    from megatron_mllm.data.task_encoder import check_tokenizer
    from megatron_mllm.data.tokenizer import load_tokenizer

    check_energon_dataset(args.data_path)
    account = account_samples(args.data_path, args.max_skipped_samples_fraction)
    args.data_left_out = list(account.left_out)
    if account.left_out and args.rank == 0:
        print(
            f"WARNING: --data-path {args.data_path}: {account.summary()}, within "
            f"--max-skipped-samples-fraction {args.max_skipped_samples_fraction:g}",
            file=sys.stderr,
        )
    if args.eval_iters:
        check_has_validation(args.data_path)
        share = validation_samples(args.data_path, account.left_out) // (
            args.data_parallel_size * max(1, args.num_workers)
        )
        if share < args.micro_batch_size:
            raise ConfigError(
                f"{args.data_path}: each DP rank's loader worker gets {share} validation "
                f"samples, fewer than --micro-batch-size {args.micro_batch_size}; convert with "
                "a larger --val-fraction, or use fewer workers or a smaller micro-batch"
            )
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise ConfigError(
            "--data-path needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR"
        )
    tok = load_tokenizer(args.tokenizer_model, args.image_token)
    check_tokenizer(tok, args.tokenizer_model)
    if args.use_checkpoint_args:  # the checkpoint's vocabulary must hold the tokenizer's
        if len(tok) > args.vocab_size:
            raise ConfigError(
                f"--tokenizer-model {args.tokenizer_model} has {len(tok)} tokens, more than "
                f"the checkpoint's vocabulary of {args.vocab_size}"
            )
    else:  # Megatron pads a tokenizer's vocabulary for TP
        step = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.vocab_size = -(-len(tok) // step) * step
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers {args.num_workers}: give 0 or more")
    if args.eval_iters < 0 or (args.eval_interval is not None and args.eval_interval < 1):
        raise ConfigError("--eval-iters must be >= 0 and --eval-interval >= 1")
    if args.coreset is not None:
        from megatron_mllm.data.energon_llava import train_sources

        args.data_sources = list(train_sources(args.data_path))


def _check_plan_candidates(args) -> None:
    """--plan-candidates K: Optimus plans on our executor, each given its steps."""
    k = args.plan_candidates
    if k is None:
        return
    from megatron_mllm.training.plan_candidates import CandidatePhase, check_counts

    check_counts(k, args.plan_candidate_steps)
    others = {
        "--bubble-schedule optimus-adaptive (it plans every step itself)": args.step_plans,
        "--coreset-pool-ratio (its pool schedule is built for one layout)": args.coreset,
        "--replan-after-iters (candidates are re-planned after warm-up)": (
            args.replan_after_iters is not None
        ),
        "--encoder-tensor-model-parallel-size (a forced encoder plan leaves nothing to try)": (
            args.encoder_tensor_model_parallel_size
        ),
    }
    for what, given in others.items():
        if given:
            raise ConfigError(f"--plan-candidates does not run with {what}; drop one of the two")
    if args.bubble_schedule != "optimus":
        raise ConfigError(
            f"--plan-candidates tries Optimus plans; use --bubble-schedule optimus (got "
            f"{args.bubble_schedule})"
        )
    steps = CandidatePhase((None,) * (k + 1), args.plan_candidate_steps).steps
    if args.train_iters < steps:
        raise ConfigError(
            f"--train-iters {args.train_iters} ends inside the plan-candidate phase (up to "
            f"{steps} iterations for K={k}); train longer or lower --plan-candidates"
        )


def _check_lookahead(args: argparse.Namespace) -> None:
    """--coreset-lookahead needs a coreset and a fixed schedule; without pipeline stages it
    has no bubbles to hide the pool in: accepted with a warning (selection one step old)."""
    if not args.coreset_lookahead:
        return
    if args.coreset is None:
        raise ConfigError("--coreset-lookahead needs --coreset-pool-ratio R (a coreset to select)")
    if args.replan_after_iters is not None:
        raise ConfigError(
            "--coreset-lookahead runs one merged schedule for the whole run; drop "
            "--replan-after-iters"
        )
    if args.pipeline_model_parallel_size == 1 and args.rank == 0:
        print(
            "WARNING: --coreset-lookahead at --pipeline-model-parallel-size 1: no pipeline "
            "bubbles to hide the next pool's forward in; it runs after the step's own work "
            "(selection one step old, no time saved)",
            file=sys.stderr,
        )


def validate_args(args: argparse.Namespace) -> None:
    """Every combination that cannot work, as one line, before any group or file is touched."""
    tp, pp, world = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.world_size,
    )
    # optimus-adaptive is the optimus plan plus per-step plans (runtime/planning/step_plans.py)
    args.step_plans = args.bubble_schedule == "optimus-adaptive"
    if args.step_plans:
        args.bubble_schedule = "optimus"
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
    etp, epp = args.encoder_tensor_model_parallel_size, args.encoder_pipeline_model_parallel_size
    if (etp is None) != (epp is None):
        raise ConfigError(
            "give both --encoder-tensor-model-parallel-size and "
            "--encoder-pipeline-model-parallel-size, or neither"
        )
    if etp is not None:
        if args.bubble_schedule != "optimus":
            raise ConfigError("an encoder plan needs --bubble-schedule optimus")
        if tp % etp or pp % epp:
            raise ConfigError(f"encoder TP {etp} / PP {epp} must divide backbone TP {tp} / PP {pp}")
        if args.encoder_num_layers % epp:
            raise ConfigError(
                f"--encoder-num-layers {args.encoder_num_layers} does not split "
                f"over encoder PP {epp}"
            )
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
    _check_data(args)
    if args.step_plans and (args.coreset is not None or args.replan_after_iters is not None):
        raise ConfigError(
            "--bubble-schedule optimus-adaptive plans each step for its data; it does not run "
            "with --coreset-pool-ratio or --replan-after-iters (use --bubble-schedule optimus)"
        )
    _check_lookahead(args)
    _check_plan_candidates(args)
    if args.replan_after_iters is not None:
        if args.replan_after_iters < 1 or args.bubble_schedule != "optimus":
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
