"""Encoder loads that vary with the data: a distribution of images per sample
(`--images-per-sample 0:0.1,1:0.6,2:0.2,4:0.1`: the share of samples with that many images),
global batches drawn from it (or read from a file), and how a global batch's samples go into
DP replicas and micro-batches: as the loader gives them, or cost-balanced (data-aware Optimus).

A micro-batch's load is its images per sample over the images per sample the encoder's costs
are computed for (1.0: as costed); a text-only micro-batch's load is 0.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from pathlib import Path

from megatron_mllm.errors import ConfigError

Distribution = dict[int, float]  # images in a sample -> share of samples


def parse_distribution(
    text: str, flag: str = "--images-per-sample", example: str = "0:0.1,1:0.6,2:0.2,4:0.1"
) -> Distribution:
    """`"0:0.1,1:0.6,2:0.2,4:0.1"` -> {0: 0.1, 1: 0.6, 2: 0.2, 4: 0.1} (a whole number -> its
    share); one line naming `flag` for bad input."""
    out: Distribution = {}
    for part in text.split(","):
        count, sep, share = part.partition(":")
        try:
            n, p = int(count), float(share)
        except ValueError:
            n, p = -1, math.nan
        if not sep or not math.isfinite(p) or n < 0 or p < 0:
            raise ConfigError(
                f"{flag} {text!r}: {part!r} is not VALUE:SHARE with a whole number >= 0 and a "
                f"share >= 0 (e.g. {example})"
            )
        if n in out:
            raise ConfigError(f"{flag} {text!r}: {n} given twice")
        out[n] = p
    if abs(sum(out.values()) - 1.0) > 1e-6:
        raise ConfigError(f"{flag} {text!r}: the shares sum to {sum(out.values()):g}, not 1")
    return out


def mean_images(dist: Distribution) -> float:
    return sum(n * p for n, p in dist.items())


def draw_samples(
    dist: Distribution, steps: int, global_batch: int, seed: int = 0
) -> list[list[int]]:
    """`steps` global batches: each sample's image count, in the order the loader gives them
    (reproducible from `seed`)."""
    if steps < 1:
        raise ConfigError(f"--sample-steps {steps}: give 1 or more")
    rng = random.Random(seed)
    counts, shares = zip(*sorted(dist.items()), strict=True)
    return [rng.choices(counts, weights=shares, k=global_batch) for _ in range(steps)]


def load_samples(path: str, global_batch: int) -> list[list[int]]:
    """`--encoder-loads FILE`: JSON `{"global_batch": G, "steps": [[images per sample, ...],
    ...]}` (e.g. measured from a data set); one line for a file that does not fit the job."""
    try:
        raw = json.loads(Path(path).read_text())
        given, steps = int(raw["global_batch"]), [[int(x) for x in s] for s in raw["steps"]]
    except FileNotFoundError:
        raise ConfigError(f"--encoder-loads {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--encoder-loads {path}: not JSON of the form "
            '{"global_batch": G, "steps": [[images per sample, ...], ...]}'
        ) from None
    if given != global_batch or any(len(s) != global_batch for s in steps):
        raise ConfigError(
            f"--encoder-loads {path}: its steps are for a global batch of {given} samples, the "
            f"job's is {global_batch}; give loads drawn for --global-batch {global_batch}"
        )
    if not steps or any(x < 0 for s in steps for x in s):
        raise ConfigError(f"--encoder-loads {path}: give one or more steps of counts >= 0")
    return steps


# Which samples each DP replica trains and how they form its micro-batches:
# [replica][micro-batch] -> sample indices of the global batch.
Assignment = list[list[list[int]]]


def loader_assignment(global_batch: int, dp: int, micro_batch: int) -> Assignment:
    """As the loader gives them: replica r takes the r-th contiguous share, in order."""
    per = global_batch // dp
    return [
        [list(range(r * per + m, r * per + m + micro_batch)) for m in range(0, per, micro_batch)]
        for r in range(dp)
    ]


def balanced_assignment(counts: list[int], dp: int, micro_batch: int) -> Assignment:
    """Samples into micro-batches and micro-batches into replicas with equal image counts as
    far as they go (largest first into the lightest bin with room, for both). The global batch
    is the same samples (docs/performance.md, "Data-aware Optimus", says when the gradient is
    unchanged)."""
    n_mb = len(counts) // micro_batch
    bins: list[list[int]] = [[] for _ in range(n_mb)]
    heap = [(0, b) for b in range(n_mb)]
    for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        if len(bins[b]) < micro_batch:
            heapq.heappush(heap, (load + counts[i], b))
    per = n_mb // dp
    replicas: Assignment = [[] for _ in range(dp)]
    heap = [(0, r) for r in range(dp)]
    for b in sorted(range(n_mb), key=lambda b: (-sum(counts[i] for i in bins[b]), b)):
        load, r = heapq.heappop(heap)
        replicas[r].append(bins[b])
        if len(replicas[r]) < per:
            heapq.heappush(heap, (load + sum(counts[i] for i in bins[b]), r))
    return replicas


def micro_loads(counts: list[int], microbatches: list[list[int]], costed: float) -> tuple:
    """Each micro-batch's encoder load: its images per sample over the `costed` images per
    sample the encoder's costs are for (0 for a text-only micro-batch)."""
    return tuple(sum(counts[i] for i in mb) / len(mb) / (costed or 1.0) for mb in microbatches)


def heaviest(counts: list[int], assignment: Assignment) -> int:
    """The replica with the most images: the one the step waits for at the DP reduction."""
    return max(
        range(len(assignment)), key=lambda r: sum(counts[i] for mb in assignment[r] for i in mb)
    )
