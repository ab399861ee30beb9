"""`plan_schedule.py --preset NAME`: a whole job by name (models, parallel plan, batch, data),
each of its settings overridable by the usual flag; and, for a native-resolution tower, each
sample's encoder load drawn from image counts and image sizes (`--image-pixels`)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.loads import parse_distribution
from megatron_mllm.schedule.patch_loads import TowerShape, draw_native_loads


@dataclass(frozen=True)
class Preset:
    """A job's flags (by plan_schedule.py's argument names) and, for a native-resolution
    tower, its shape, patch size and nominal image (the encoder spec's `seq_len` patches)."""

    flags: dict
    tower: TowerShape | None = None
    patch: int = 14
    nominal: tuple[int, int] = (32, 32)


# Qwen2.5-VL-72B fine-tuning on packed rows. The backbone (Qwen2-72B) at TP 8 (one node's
# NVLink domain) and PP 4 (20 layers a stage: the model states and a packed row's activations
# fit in 80 GB); 256 H100s, so DP 8: eight replicas whose rows' images differ, the straggler
# case. 256 rows of 8192 tokens a step (about 2M tokens), 32 micro-batches of one row per
# replica. The tower: 32 layers of 1280 (16 heads, gated MLP of 3420), windows of 4 x 4
# merged tokens (112 px) but in 4 full-attention layers, 14-pixel patches merged 2 x 2;
# at scale it attends image by image and window by window (a variable-length kernel).
# A row's images: 0 to 4 (conversations packed together), 224 to 1344 px a side, taking
# at most three quarters of the row's tokens (`native_steps`).
PRESETS = {
    "qwen2.5-vl-72b": Preset(
        flags=dict(
            encoder=["qwen2.5-vl-vit"],
            backbone="qwen2-72b",
            gpus=256,
            tp=8,
            pp=4,
            global_batch=256,
            micro_batch=1,
            seq_len=8192,
            images_per_sample="0:0.1,1:0.2,2:0.3,3:0.25,4:0.15",
            image_pixels="50176:0.3,200704:0.35,802816:0.25,1806336:0.1",
        ),
        tower=TowerShape(
            1280, 3420, 32, gated=True, merge=2, window=4, full_layers=4, masked=False
        ),
    )
}
REQUIRED = ("encoder", "backbone", "gpus", "global_batch", "seq_len")
DEFAULTS = dict(tp=1, pp=1, micro_batch=1)  # where neither the user nor a preset says


def apply_preset(args: argparse.Namespace) -> Preset | None:
    """Fill every setting the user left out from `--preset` (None without one), then from
    DEFAULTS; refuse a job without the required settings in one line."""
    preset = PRESETS[args.preset] if args.preset else None
    for name, value in {**DEFAULTS, **(preset.flags if preset else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    missing = [f"--{n.replace('_', '-')}" for n in REQUIRED if getattr(args, n) is None]
    if missing:
        raise ConfigError(
            f"give {', '.join(missing)} (or a whole job: --preset {' | '.join(PRESETS)})"
        )
    if args.image_pixels is not None and (preset is None or preset.tower is None):
        raise ConfigError(
            "--image-pixels draws image sizes for a native-resolution tower; give a preset "
            f"with one (--preset {' | '.join(p for p in PRESETS if PRESETS[p].tower)})"
        )
    return preset


def native_steps(args: argparse.Namespace, preset: Preset, global_batch: int) -> tuple[list, float]:
    """Each drawn step's per-sample loads in nominal images (by patches) and their mean."""
    images = parse_distribution(args.images_per_sample or "1:1")
    pixels = parse_distribution(
        args.image_pixels, "--image-pixels", "50176:0.5,802816:0.5 (224 and 896 px squares)"
    )
    if 0 in pixels:
        raise ConfigError(f"--image-pixels {args.image_pixels!r}: give images of 1 or more pixels")
    steps = draw_native_loads(
        images,
        pixels,
        args.sample_steps,
        global_batch,
        preset.tower,
        preset.patch,
        preset.nominal,
        args.seed,
        max_tokens=args.seq_len * 3 // 4,  # a row's images leave a quarter for its text
    )
    return steps, statistics.fmean(x for s in steps for x in s)
