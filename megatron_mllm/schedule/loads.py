"""Encoder loads that vary with the data: a distribution of images per sample
(`--images-per-sample 0:0.1,1:0.6,2:0.2,4:0.1`: the share of samples with that many images)
and steps of per-micro-batch loads drawn from it, for the simulator (`Workload.encoder_load`).

A micro-batch's load is its images over its samples: 1.0 is one image per sample, the load
the encoder's costs are computed for; a text-only micro-batch's load is 0.
"""

from __future__ import annotations

import math
import random

from megatron_mllm.errors import ConfigError

Distribution = dict[int, float]  # images in a sample -> share of samples


def parse_distribution(text: str) -> Distribution:
    """`"0:0.1,1:0.6,2:0.2,4:0.1"` -> {0: 0.1, 1: 0.6, 2: 0.2, 4: 0.1}; one line for bad input."""
    out: Distribution = {}
    for part in text.split(","):
        count, sep, share = part.partition(":")
        try:
            n, p = int(count), float(share)
        except ValueError:
            n, p = -1, math.nan
        if not sep or not math.isfinite(p) or n < 0 or p < 0:
            raise ConfigError(
                f"--images-per-sample {text!r}: {part!r} is not IMAGES:SHARE with a whole "
                "number of images >= 0 and a share >= 0 (e.g. 0:0.1,1:0.6,2:0.2,4:0.1)"
            )
        if n in out:
            raise ConfigError(f"--images-per-sample {text!r}: {n} images given twice")
        out[n] = p
    if abs(sum(out.values()) - 1.0) > 1e-6:
        raise ConfigError(
            f"--images-per-sample {text!r}: the shares sum to {sum(out.values()):g}, not 1"
        )
    return out


def mean_images(dist: Distribution) -> float:
    return sum(n * p for n, p in dist.items())


def draw_step_loads(
    dist: Distribution, steps: int, micro_batch: int, num_microbatches: int, seed: int = 0
) -> list[tuple[float, ...]]:
    """`steps` steps of `num_microbatches` micro-batch loads, each the mean image count of
    `micro_batch` samples drawn from `dist` (reproducible from `seed`)."""
    if steps < 1:
        raise ConfigError(f"--sample-steps {steps}: give 1 or more")
    rng = random.Random(seed)
    counts, shares = zip(*sorted(dist.items()), strict=True)
    out = []
    for _ in range(steps):
        drawn = rng.choices(counts, weights=shares, k=micro_batch * num_microbatches)
        out.append(
            tuple(
                sum(drawn[m * micro_batch : (m + 1) * micro_batch]) / micro_batch
                for m in range(num_microbatches)
            )
        )
    return out
