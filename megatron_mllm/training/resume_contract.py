"""What a run may do with --load and --save, checked before any process group or file is
touched (Megatron's resume contract, plus what keeps a --save directory one run's).

* The checkpoint's model arguments must equal the run's (else --use-checkpoint-args).
* Its LR-schedule arguments must equal the run's, unless --override-opt_param-scheduler (the
  run's win) or --use-checkpoint-opt_param-scheduler (the checkpoint's win) says which side.
* A resumed run must have iterations left: --train-iters above the checkpoint's iteration.
* The checkpoint's files match its manifest (sizes, CRC-32), and --load holds one run's.
* --save is a writable directory (or one that can be made), and holds no other run's
  checkpoints: a fresh run needs it empty, a resumed one needs it to be --load or empty, so its
  tracker only ever moves forward.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_mllm.errors import ConfigError, flag
from megatron_mllm.training import manifest
from megatron_mllm.training.checkpointing import (
    checkpoint_dir,
    latest_iteration,
    read_common,
    tracked,
)


def _unverified(args: argparse.Namespace, iteration: int) -> None:
    """A checkpoint without a manifest: refused where another checkpoint of the same --load
    has one (its manifest was removed), unless --allow-unverified-checkpoint; else loaded
    with a warning (saved before manifests were written)."""
    from pathlib import Path

    siblings = [
        p.parent.name
        for p in Path(args.load).glob(f"iter_*/{manifest.MANIFEST}")
        if p.parent.name != checkpoint_dir(args.load, iteration).name
    ]
    if siblings and not args.allow_unverified_checkpoint:
        raise ConfigError(
            f"--load {args.load}: iteration {iteration} has no manifest while "
            f"{sorted(siblings)[0]} of the same run has one; its files cannot be verified "
            "(restore the manifest, load another checkpoint, or pass "
            "--allow-unverified-checkpoint)"
        )
    if args.rank == 0:
        print(
            f"WARNING: --load {args.load}: iteration {iteration} has no manifest; its files are "
            "not verified",
            file=sys.stderr,
        )


def check_resume(args: argparse.Namespace, model_args: tuple[str, ...]) -> None:
    """Refuse, in one line, a --load that this run cannot continue faithfully."""
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both "
            "given; choose the side whose LR schedule wins"
        )
    if args.load is None:
        return
    iteration = latest_iteration(args.load)
    _one_run(args.load)
    if not manifest.verify(checkpoint_dir(args.load, iteration), args.rank, args.world_size):
        _unverified(args, iteration)
    common = read_common(args.load)
    saved = common.get("args", {})
    _same_model(args, saved, model_args)
    if common.get("model_only"):  # weights only: a new run starts from them at iteration 0
        return
    if iteration >= args.train_iters:
        raise ConfigError(
            f"--load {args.load} is at iteration {iteration}, not below --train-iters "
            f"{args.train_iters}: nothing is left to train; give --train-iters above {iteration} "
            "(with --override-opt_param-scheduler where --train-iters sets the LR decay)"
        )
    if "scheduler" in common:
        _same_schedule(args, common["scheduler"])
    _same_tokenizer(args, common.get("tokenizer"))


def _same_tokenizer(args: argparse.Namespace, saved: dict | None) -> None:
    """The tokenizer that wrote the checkpoint's embeddings is the one training goes on with
    (two tokenizers padded to one vocabulary size would silently misalign every token)."""
    if saved is None or not args.tokenizer_model or args.allow_tokenizer_change:
        return
    from megatron_mllm.data.tokenizer import tokenizer_identity

    mine = tokenizer_identity(args.tokenizer_model, args.image_token)
    if mine != saved:
        what = "image token" if mine["sha256"] == saved["sha256"] else "tokenizer files"
        raise ConfigError(
            f"--load {args.load} was trained with another tokenizer ({what} differ: "
            f"{saved['sha256'][:12]} {saved['image_token']!r} there, {mine['sha256'][:12]} "
            f"{mine['image_token']!r} in --tokenizer-model {args.tokenizer_model}); resume with "
            "its tokenizer, or pass --allow-tokenizer-change"
        )


def _one_run(root: str) -> None:
    """Refuse a directory whose checkpoints belong to different runs (by their manifests)."""
    runs: dict[str, str] = {}
    for directory in sorted(Path(root).glob("iter_*")):
        held = manifest.read(directory) if directory.is_dir() else None
        if held and held.get("run_id"):
            runs.setdefault(held["run_id"], directory.name)
    if len(runs) > 1:
        first, second = list(runs.values())[:2]
        raise ConfigError(
            f"--load {root} mixes checkpoints of {len(runs)} runs ({first} and {second} differ); "
            "keep one run's checkpoints per directory"
        )


def _same_model(args, saved: dict, model_args: tuple[str, ...]) -> None:
    differ = [k for k in model_args if k in saved and saved[k] != getattr(args, k)]
    if differ:
        theirs = " ".join(f"{flag(k)} {saved[k]}" for k in differ)
        ours = " ".join(f"{flag(k)} {getattr(args, k)}" for k in differ)
        raise ConfigError(
            f"--load {args.load} holds another model ({theirs}; this run: {ours}); give the "
            "checkpoint's values or --use-checkpoint-args"
        )


def schedule_values(args) -> dict[str, tuple[str, object]]:
    """megatron-core's OptimizerParamScheduler state names -> (the flag, this run's value)."""
    decay = args.lr_decay_iters or args.train_iters
    decay_flag = "the LR decay length (--lr-decay-iters, else --train-iters)"
    return {
        "max_lr": ("--lr", float(args.lr)),
        "min_lr": ("--min-lr", args.min_lr),
        "lr_warmup_steps": ("--lr-warmup-iters", args.lr_warmup_iters),
        "lr_decay_steps": (decay_flag, decay),
        "lr_decay_style": ("--lr-decay-style", args.lr_decay_style),
        "start_wd": ("--weight-decay", args.weight_decay),
    }


def _same_schedule(args, state: dict) -> None:
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    for key, (name, ours) in schedule_values(args).items():
        if key in state and state[key] != ours:
            raise ConfigError(
                f"--load {args.load} was trained with {name} {state[key]}, this run has "
                f"{ours}; say which wins: --override-opt_param-scheduler (this run's) or "
                "--use-checkpoint-opt_param-scheduler (the checkpoint's)"
            )


def check_save(args: argparse.Namespace) -> None:
    """--save must be (or be able to become) a writable directory holding no other run."""
    if args.save is None:
        return
    path = Path(args.save)
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--save {args.save}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {args.save}: {existing} is not writable; give another path")
    held = tracked(path)
    if held is None:
        return
    if args.load is None:
        raise ConfigError(
            f"--save {args.save} already holds a run's checkpoints (latest iteration {held}); "
            f"resume it with --load {args.save}, or give an empty --save directory"
        )
    if Path(args.load).resolve() != path.resolve():
        raise ConfigError(
            f"--save {args.save} holds another run's checkpoints (latest iteration {held}) than "
            f"--load {args.load}; save into --load's directory or an empty one"
        )
