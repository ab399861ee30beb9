"""Megatron-style command-line arguments for pretrain_mllm.py, in Megatron's argument groups
(`_add_*_args`); `parse_args` checks them (argument_checks.py) before anything starts."""

from __future__ import annotations

import argparse
import os

from megatron_mllm.errors import ConfigError, OneLineParser
from megatron_mllm.schedule.lookahead import SHIFTS
from megatron_mllm.training.argument_checks import ENCODER_SPEC_KEYS, MODEL_ARGS, validate_args
from megatron_mllm.training.plan_candidates import LAYOUT_WARMUP, STEPS_EACH


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        description="Train a multimodal LLM (ViT + projector + GPT) on megatron-core."
    )
    _add_parallel_args(p)
    _add_schedule_args(p)
    _add_model_args(p)
    _add_data_args(p)
    _add_training_args(p)
    _add_checkpoint_and_logging_args(p)
    return p


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
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


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
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
        "--encoder-wgrad-split",
        action="store_true",
        help="optimus: the encoder's backward split into input-gradient work and weight-gradient "
        "work that waits for a later bubble (zero-bubble's B / W); kept where the planner "
        "predicts it faster (local layers); with --plan-candidates, the best Optimus "
        "plan's split variant is one more candidate",
    )
    g.add_argument(
        "--backbone-wgrad-split",
        action="store_true",
        help="optimus, megatron, balanced: the backbone's backward split where a pipeline peer "
        "waits for its input gradient (the last stage's first micro-batch, every stage's "
        "last), its weight gradients in a later bubble (zero-bubble's B / W); kept where the "
        "planner predicts it faster (local layers, TP 1, PP >= 2, no virtual stages, no full "
        "recomputation); with --plan-candidates, the best Optimus plan's split variant is one "
        "more candidate",
    )
    g.add_argument(
        "--replan-after-iters",
        type=int,
        default=None,
        help="optimus: after N iterations, plan again from the unit times measured so far (with a "
        "coreset: its pool pass and look-ahead merge too)",
    )
    g.add_argument(
        "--plan-candidates",
        type=int,
        default=None,
        metavar="K",
        help="optimus: the planner's K best plans (one per encoder plan, stage order included, "
        "and placement) and the Megatron schedule each train --plan-candidate-steps real "
        "steps after warm-up "
        "(re-planned and predicted from the times this job measured first); the fastest "
        "measured trains on",
    )
    g.add_argument(
        "--plan-candidate-steps",
        type=int,
        default=STEPS_EACH,
        help="with --plan-candidates: timed steps per candidate plus one (split into two windows "
        "mirrored around the phase's middle, each with one warm-up step); a close call between "
        "the two fastest runs them once more",
    )
    g.add_argument(
        "--plan-candidate-layout-warmup",
        type=int,
        default=LAYOUT_WARMUP,
        metavar="N",
        help="with --plan-candidates: warm-up steps on each module layout after the first plan's "
        "(the first not read), so that each candidate is predicted from the unit times of its "
        "own modules; 0: every candidate predicted from the first plan's warm-up",
    )
    g.add_argument(
        "--coreset-lookahead",
        action="store_true",
        help="coreset: the next step's pool goes forward in this step's pipeline bubbles and is "
        "selected with this step's weights (one step old when it trains)",
    )
    g.add_argument(
        "--coreset-lookahead-order",
        choices=list(SHIFTS),
        default=None,
        help="with --coreset-lookahead: where the next pool's forwards go in each rank's list: "
        "where simulation finds the step shortest over shifts of the pool's timeline (default: "
        "simulated), all of them first (pool-first), or searched further, each rank's pool "
        "groups moved on their own, once per count of pool micro-batches at start-up (searched: "
        "a few seconds a count at PP 2, so a pool of 16 micro-batches a rank adds about a "
        "minute; more with more stages)",
    )
    g.add_argument(
        "--coreset-features",
        choices=["zo", "exact"],
        default="zo",
        help="zo: each example's loss derivative along --coreset-directions random directions "
        "of the output weight (in closed form for the softmax output layer); exact: its whole "
        "per-example gradient",
    )
    g.add_argument(
        "--coreset-directions", type=int, default=16, help="random directions for zo features"
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
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
        choices=["vit", "clip", "qwen2vl", "qwen2.5vl"],
        default="vit",
        help="vit: patches + final norm; clip: LLaVA's CLIP tower (class token, pre-norm, "
        "quick_gelu, no final norm); qwen2vl: Qwen2-VL's native-resolution tower (each image "
        "at its own size, 2-D rotary positions, attention within an image, the patch merger; "
        "--img-h is then the nominal image the planner costs); qwen2.5vl: Qwen2.5-VL's (RMSNorm, "
        "gated SiLU MLP, attention within windows but in the full-attention layers)",
    )
    g.add_argument(
        "--encoder-window-size",
        type=int,
        default=None,
        help="qwen2.5vl: the attention window's side in pixels (Qwen2.5-VL's window_size; "
        "default 4 merged tokens: 112 at patch 14, merge 2; 0: no windows)",
    )
    g.add_argument(
        "--encoder-full-attention-layers",
        type=int,
        nargs="*",
        default=None,
        metavar="I",
        help="qwen2.5vl: the tower's layers (from 0) attending the whole image (Qwen2.5-VL's "
        "fullatt_block_indexes; default the last of each quarter: 7 15 23 31 of 32)",
    )
    g.add_argument(
        "--spatial-merge-size",
        type=int,
        default=2,
        help="qwen2vl, qwen2.5vl: patches merged into one backbone token along each side",
    )
    g.add_argument(
        "--temporal-patch-size",
        type=int,
        default=2,
        help="qwen2vl, qwen2.5vl: frames a patch spans (a still image is repeated over them)",
    )
    g.add_argument(
        "--encoder-activation",
        choices=["gelu", "quick_gelu", "silu"],
        default=None,
        help="default: gelu for vit, quick_gelu for clip and qwen2vl, silu for qwen2.5vl",
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU backbone MLP")
    g.add_argument("--disable-bias-linear", action="store_true", help="no backbone linear biases")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="biases on the attention's Q, K and V (Qwen2; with --disable-bias-linear)",
    )
    g.add_argument(
        "--mrope-section",
        type=int,
        nargs=3,
        default=None,
        metavar=("T", "H", "W"),
        help="Qwen2-VL's multimodal rotary embedding: the rotary frequencies in three sections "
        "(temporal, height, width) summing to half the head dim; image tokens sit on their "
        "patch grid, text on one line (default: 1-D RoPE)",
    )
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


def _add_data_args(p: argparse.ArgumentParser) -> None:
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
        "--min-pixels",
        type=int,
        default=None,
        help="--encoder-arch qwen2vl or qwen2.5vl: the fewest pixels an image is resized to "
        "(Qwen2-VL's processor's min_pixels; default 56 x 56)",
    )
    g.add_argument(
        "--max-pixels",
        type=int,
        default=None,
        help="--encoder-arch qwen2vl or qwen2.5vl: the most pixels an image is resized to (default "
        "28 x 28 x 1280)",
    )
    g.add_argument(
        "--packing-buffer-size",
        type=int,
        default=None,
        help="sequence packing (Megatron-LM's multimodal flag): training rows of --seq-length "
        "hold several conversations, packed from buffers of this many samples (first fit, "
        "longest first), each attending only to itself with its positions restarting; needs "
        "--calculate-per-token-loss. Validation stays one sample a row",
    )
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


def _add_training_args(p: argparse.ArgumentParser) -> None:
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
    _add_precision_and_memory_args(g)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)


def _add_precision_and_memory_args(g) -> None:
    """The training group's precision, optimizer, reduction and recomputation flags."""
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


def _add_checkpoint_and_logging_args(p: argparse.ArgumentParser) -> None:
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


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """pretrain_mllm.py's arguments, checked (`validate_args`) for `world_size` ranks (default:
    WORLD_SIZE); a ConfigError names the first that cannot work."""
    args = build_parser().parse_args(argv)
    if args.use_checkpoint_args:
        if args.load is None:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        from megatron_mllm.training.checkpointing import read_common

        saved = read_common(args.load).get("args", {})
        for name in MODEL_ARGS:
            if name in saved:
                setattr(args, name, saved[name])
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    validate_args(args)
    return args
