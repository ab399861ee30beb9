"""The checks of what a run reads and how (part of `argument_checks.validate_args`): the data
set and its tokenizer, sequence packing, and a native-resolution tower's images. Each refusal
is one line, before any process group or file is touched."""

from __future__ import annotations

import argparse
import sys

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import NATIVE_ARCHS


def check_native(args: argparse.Namespace) -> None:
    """--encoder-arch qwen2vl or qwen2.5vl: what its tower runs with here (layer units of
    megatron-core's local layers) and what it does not yet; --min-pixels / --max-pixels only
    with it (the window flags only with qwen2.5vl)."""
    _check_windows_need_qwen25(args)
    if args.encoder_arch not in NATIVE_ARCHS:
        _check_pixels_need_native(args)
        return
    refused = {
        "--recompute-vision": args.recompute_vision,
        "--transformer-impl transformer_engine": args.transformer_impl == "transformer_engine",
        "--coreset-pool-ratio": args.coreset is not None,
    }
    for what, given in refused.items():
        if given:
            raise ConfigError(f"--encoder-arch {args.encoder_arch} does not run with {what}")
    for name in ("spatial_merge_size", "temporal_patch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    low, high = args.min_pixels, args.max_pixels
    if (low is not None and low < 1) or (high is not None and high < 1):
        raise ConfigError("--min-pixels and --max-pixels must be positive pixel counts")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"--min-pixels {low} is above --max-pixels {high}")


def _check_pixels_need_native(args: argparse.Namespace) -> None:
    if args.min_pixels or args.max_pixels:
        raise ConfigError(
            "--min-pixels and --max-pixels size native images: add --encoder-arch qwen2vl"
        )


def _check_windows_need_qwen25(args: argparse.Namespace) -> None:
    window = ("encoder_window_size", "encoder_full_attention_layers")
    given = [n for n in window if getattr(args, n, None) is not None]
    if given and args.encoder_arch != "qwen2.5vl":
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(
            f"{flag} sets Qwen2.5-VL's attention windows: add --encoder-arch qwen2.5vl"
        )


def check_packing(args: argparse.Namespace) -> None:
    """--packing-buffer-size: conversation data, a per-token loss (a row's sample count
    varies, so a mean per row would weigh samples differently), the local attention path
    (its [b, 1, s, s] mask), and none of the features that move samples between rows."""
    size = args.packing_buffer_size
    if size is None:
        return
    if size < 1:
        raise ConfigError(f"--packing-buffer-size {size}: give a buffer of 1 or more samples")
    refused = {
        "--data-path (synthetic data is one sample a row)": args.data_path is None,
        "--calculate-per-token-loss (with a mean per row, the samples' weights would depend "
        "on how they were packed)": not args.calculate_per_token_loss,
    }
    for what, missing in refused.items():
        if missing:
            raise ConfigError(f"--packing-buffer-size needs {what}")
    others = {
        "--coreset-pool-ratio (selection picks samples, a packed row holds several)": (
            args.coreset is not None
        ),
        "--transformer-impl transformer_engine (packed rows use the local attention path's "
        "mask; THD packing with Transformer Engine is not here)": (
            args.transformer_impl == "transformer_engine"
        ),
    }
    for what, given in others.items():
        if given:
            raise ConfigError(f"--packing-buffer-size does not run with {what}")


def check_data(args: argparse.Namespace) -> None:
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
