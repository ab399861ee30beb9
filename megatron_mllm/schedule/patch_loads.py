"""What a micro-batch costs a native-resolution tower, relative to the nominal images the cost
model's encoder blocks are made for (an encoder load per sample, see `loads.py`).

A layer's work: its GEMMs, linear in the patches (QKV and output projections 4 h^2
multiply-adds a patch, the MLP 2 h f, or 3 h f gated), and attention, quadratic in the length
it is computed over (scores and values: 2 h l^2). Which length depends on the attention kernel:
megatron-core's local attention, which our tower runs, computes the micro-batch's whole patch
sequence (every image concatenated) and masks what may not attend (`masked`); a
variable-length kernel computes each image, or each window in Qwen2.5-VL's windowed layers (the
windows tile the merged grid, the last ones cut short). The nominal micro-batch is one nominal
image a sample, each computed apart, as the cost model's encoder blocks cost it. The patch
embedding and the merger are linear and small beside the layers; they follow the same factor.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

Grid = tuple[int, int]  # an image's patch rows and columns
PROFILE_DRAWS = 4096  # micro-batches drawn for a profiled tower's expected load


@dataclass(frozen=True)
class TowerShape:
    """The native tower's shape as its cost depends on it."""

    hidden: int
    ffn: int
    layers: int
    gated: bool = False
    merge: int = 2
    window: int = 0  # a window's side in merged tokens (0: every layer attends whole images)
    full_layers: int = 0  # of the layers, those attending whole images where there are windows
    masked: bool = True  # attention over the micro-batch's whole sequence under a mask
    # Measured on the machine (`calibrated`): work a micro-batch with images costs whatever
    # their sizes (masks, rotary angles, per-op dispatch), in multiply-adds, and the attention's
    # cost over its multiply-adds (the scores' mask and softmax are element-wise work).
    fixed: float = 0.0
    attention_scale: float = 1.0
    # Profiled on the machine (`profiled`): under the mask, the measured cost's ratio to the
    # flop count at these patch counts (ascending); between them it is interpolated linearly,
    # beyond them the nearest one holds. What no two terms capture: a long sequence's scores
    # leaving the caches, a short one's per-op dispatch.
    profile: tuple[tuple[int, float], ...] = ()

    @property
    def per_patch(self) -> float:
        """Multiply-adds of every layer's GEMMs on one patch."""
        h = self.hidden
        return self.layers * (4 * h * h + (3 if self.gated else 2) * h * self.ffn)

    def attention(self, length: int) -> float:
        """Multiply-adds of every layer's attention computed over `length` patches."""
        return self.attention_scale * self.layers * 2 * self.hidden * length * length

    def image_attention(self, grid: Grid) -> float:
        """Every layer's attention on one image computed apart (a variable-length kernel)."""
        n = grid[0] * grid[1]
        if not self.window:
            return self.attention(n)
        windows = sum(length**2 for length in self.window_lengths(*grid))
        full = min(self.full_layers, self.layers)
        per_layer = self.attention(1) / self.layers
        return per_layer * (full * n * n + (self.layers - full) * windows)

    def window_lengths(self, grid_h: int, grid_w: int) -> list[int]:
        """Patches in each attention window of a grid_h x grid_w image."""
        m, ws = self.merge, self.window
        rows, cols = grid_h // m, grid_w // m
        return [
            min(ws, rows - r) * min(ws, cols - c) * m * m
            for r in range(0, rows, ws)
            for c in range(0, cols, ws)
        ]

    def nominal_cost(self, nominal: Grid) -> float:
        """One nominal image, computed apart: a sample's cost at load 1."""
        n = nominal[0] * nominal[1]
        return self.masked_cost(n)

    def masked_cost(self, patches: int) -> float:
        """Multiply-adds of the tower on one masked sequence of `patches` patches."""
        flops = self.fixed + self.per_patch * patches + self.attention(patches)
        return flops * self.profile_factor(patches)

    def profile_factor(self, patches: int) -> float:
        """The profiled cost's ratio to the flop count at `patches` (1 unprofiled)."""
        points = self.profile
        if not points:
            return 1.0
        if patches <= points[0][0]:
            return points[0][1]
        for (n0, f0), (n1, f1) in zip(points, points[1:], strict=False):
            if patches <= n1:
                return f0 + (f1 - f0) * (patches - n0) / (n1 - n0)
        return points[-1][1]

    def microbatch_cost(self, samples: list[list[Grid]]) -> float:
        """Multiply-adds of the tower on a micro-batch (each sample: its images' grids)."""
        grids = [g for sample in samples for g in sample]
        if not grids:
            return 0.0
        patches = sum(h * w for h, w in grids)
        if self.masked:
            return self.masked_cost(patches)
        images = math.fsum(self.image_attention(g) for g in grids)
        return self.fixed + self.per_patch * patches + images


def calibrated(shape: TowerShape, nominal: Grid, measured: dict[Grid, float]) -> TowerShape:
    """`shape` with the fixed work per micro-batch and the attention's scale at which one
    image of each of two grids costs its `measured` multiple of one `nominal` image (the
    GEMMs' multiply-adds keep their count); `shape` itself where no such positive pair
    exists."""
    plain = replace(shape, fixed=0.0, attention_scale=1.0)
    n0 = nominal[0] * nominal[1]
    rows = []
    for (h, w), r in measured.items():
        n = h * w
        # fixed (1 - r) + scale (q - r q0) = r l0 - l, the cost's ratio to the nominal's
        q, q0 = plain.attention(n), plain.attention(n0)
        rows.append((1 - r, q - r * q0, r * plain.per_patch * n0 - plain.per_patch * n))
    (a, b, c), (d, e, f) = rows
    det = a * e - b * d
    if not det:
        return plain
    fixed, scale = (c * e - b * f) / det, (a * f - c * d) / det
    if fixed < 0 or scale <= 0:
        return plain
    return replace(shape, fixed=fixed, attention_scale=scale)


def profiled(shape: TowerShape, nominal: Grid, seconds: dict[int, float]) -> TowerShape:
    """`shape` with the profile of a masked sequence's measured `seconds` at each patch count
    (the nominal image's among them): at each count, the ratio of its seconds to the nominal's
    over the ratio of their flop counts."""
    plain = replace(shape, fixed=0.0, attention_scale=1.0, profile=())
    n0 = nominal[0] * nominal[1]
    if n0 not in seconds or seconds[n0] <= 0:
        raise ValueError(f"the profile needs the nominal image's {n0} patches timed")
    base = seconds[n0] / plain.masked_cost(n0)
    factors = ((n, s / base / plain.masked_cost(n)) for n, s in sorted(seconds.items()))
    return replace(plain, profile=tuple(factors))


def microbatch_load(shape: TowerShape, samples: list[list[Grid]], nominal: Grid) -> float:
    """A micro-batch's load per sample: its cost over as many nominal samples'."""
    return shape.microbatch_cost(samples) / (len(samples) * shape.nominal_cost(nominal))


def expected_load(
    shape: TowerShape, records: list[list[Grid]], micro_batch: int, nominal: Grid
) -> float:
    """The expected load per sample of a micro-batch of `micro_batch` samples drawn at random
    from `records` (each: its images' grids; 1.0 for none): under the mask the attention is
    quadratic in the micro-batch's patches, E[(sum S)^2] = b E[S^2] + b (b - 1) E[S]^2; a
    profiled tower's mean is taken over PROFILE_DRAWS micro-batches drawn with a fixed seed."""
    if not records:
        return 1.0
    b, count = micro_batch, len(records)
    patches = [sum(h * w for h, w in r) for r in records]
    mean = math.fsum(patches) / count
    if shape.masked and shape.profile:  # not quadratic: the mean over drawn micro-batches
        rng = random.Random(0)
        draws = (rng.choices(patches, k=b) for _ in range(PROFILE_DRAWS))
        total = math.fsum(shape.masked_cost(sum(d)) for d in draws) / PROFILE_DRAWS
    elif shape.masked:
        square = math.fsum(p * p for p in patches) / count
        pairs = b * square + b * (b - 1) * mean**2  # E[(patches of the micro-batch)^2]
        total = shape.per_patch * b * mean + shape.attention(1) * pairs
    else:
        per_sample = [shape.microbatch_cost([r]) for r in records]
        total = b * math.fsum(per_sample) / count
    return total / (b * shape.nominal_cost(nominal))


def square_grid(pixels: int, patch: int, merge: int) -> Grid:
    """The patch grid of a square image of about `pixels` pixels, its side rounded to a
    multiple of patch x merge (at least one), as Qwen2-VL's processor resizes it."""
    factor = patch * merge
    side = max(factor, round(math.sqrt(pixels) / factor) * factor)
    return side // patch, side // patch


def draw_native_loads(
    images: dict[int, float],
    pixels: dict[int, float],
    steps: int,
    global_batch: int,
    shape: TowerShape,
    patch: int,
    nominal: Grid,
    seed: int = 0,
    max_tokens: int | None = None,
) -> list[list[float]]:
    """`steps` global batches, each sample's load in nominal images: its image count drawn from
    `images`, each image's pixels from `pixels` (squares, see `square_grid`), its cost at that
    size over a nominal image's (`TowerShape.microbatch_cost` of the sample alone). With
    `max_tokens`, a drawn image whose merged tokens would take the sample's images past it is
    left out (its conversation would go to another row)."""
    rng = random.Random(seed)
    counts, count_shares = zip(*sorted(images.items()), strict=True)
    sizes, size_shares = zip(*sorted(pixels.items()), strict=True)
    unit = shape.nominal_cost(nominal)
    out = []
    for _ in range(steps):
        step = []
        for n in rng.choices(counts, weights=count_shares, k=global_batch):
            grids, tokens = [], 0
            for p in rng.choices(sizes, weights=size_shares, k=n):
                grid = square_grid(p, patch, shape.merge)
                more = grid[0] * grid[1] // shape.merge**2
                if max_tokens is None or tokens + more <= max_tokens:
                    grids.append(grid)
                    tokens += more
            step.append(shape.microbatch_cost([grids]) / unit if grids else 0.0)
        out.append(step)
    return out
