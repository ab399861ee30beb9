"""What an image costs a native-resolution tower, relative to the nominal image the cost model's
encoder blocks are made for (an encoder load, see `loads.py`).

A layer's work on an image of n patches: its GEMMs, linear in n (QKV and output projections
4 h^2 multiply-adds a patch, the MLP 2 h f, or 3 h f gated), and attention, quadratic in the
length it attends over (scores and values: 2 h l^2 multiply-adds): the whole image in a
full-attention layer, each window's patches in a windowed one (Qwen2.5-VL's windows tile the
merged grid, the last ones cut short). The patch embedding and the merger are linear in n and
small beside the layers; they follow the same factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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

    def image_cost(self, grid_h: int, grid_w: int) -> float:
        """Multiply-adds of the tower's layers on one image of grid_h x grid_w patches."""
        h, n = self.hidden, grid_h * grid_w
        linear = n * (4 * h * h + (3 if self.gated else 2) * h * self.ffn)
        whole = 2 * h * n * n
        if not self.window:
            return self.layers * (linear + whole)
        windowed = 2 * h * sum(length**2 for length in self.window_lengths(grid_h, grid_w))
        full = min(self.full_layers, self.layers)
        return self.layers * linear + full * whole + (self.layers - full) * windowed

    def window_lengths(self, grid_h: int, grid_w: int) -> list[int]:
        """Patches in each attention window of a grid_h x grid_w image."""
        m, ws = self.merge, self.window
        rows, cols = grid_h // m, grid_w // m
        return [
            min(ws, rows - r) * min(ws, cols - c) * m * m
            for r in range(0, rows, ws)
            for c in range(0, cols, ws)
        ]


def image_load(shape: TowerShape, grid: tuple[int, int], nominal: tuple[int, int]) -> float:
    """One image's encoder load: its cost over the nominal image's."""
    return shape.image_cost(*grid) / shape.image_cost(*nominal)


def mean_image_load(
    shape: TowerShape, grids: list[tuple[int, int]], nominal: tuple[int, int]
) -> float:
    """The mean load of the images with patch grids `grids` (1.0 for none)."""
    if not grids:
        return 1.0
    return math.fsum(image_load(shape, g, nominal) for g in grids) / len(grids)
