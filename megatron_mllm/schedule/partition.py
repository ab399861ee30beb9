"""Splitting layers over pipeline stages: the balanced dynamic program and Megatron's knobs."""

from __future__ import annotations

import numpy as np

from megatron_mllm.errors import ConfigError


def balanced_partition(costs: list[float], parts: int) -> list[int]:
    """Split `costs` into `parts` contiguous non-empty groups minimising the largest group sum.

    Dynamic program over prefix sums; returns the group sizes.
    """
    n = len(costs)
    if parts > n:
        raise ConfigError(f"cannot split {n} layers into {parts} non-empty pipeline stages")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    best = np.full((parts + 1, n + 1), inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            i = np.arange(k - 1, j)
            cand = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            arg = int(np.argmin(cand))
            best[k, j], cut[k, j] = cand[arg], i[arg]
    sizes, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k, j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def megatron_split(
    num_layers: int, pp: int, vpp: int, layer_cost: float, first_extra: float, last_extra: float
) -> list[int]:
    """Layers per virtual stage as a Megatron user would set them.

    Megatron lets the first and last pipeline stage hold a different number of layers
    (--decoder-first/last-pipeline-num-layers); the middle stages are even. With VPP > 1 the
    layers are spread evenly over the virtual stages. `first_extra`/`last_extra` are the costs
    the first/last stage carry besides their layers (encoder, LM head).
    """
    stages = pp * vpp
    if stages > num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} pipeline stages")
    if vpp > 1 or pp == 1:
        base, rest = divmod(num_layers, stages)
        return [base + (1 if i < rest else 0) for i in range(stages)]
    best, best_sizes = float("inf"), None
    for first in range(1, num_layers - pp + 2):
        for last in range(1, num_layers - first - (pp - 2) + 1):
            middle = num_layers - first - last
            if pp == 2:
                if middle:
                    continue
                sizes = [first, last]
            else:
                if middle < pp - 2 or middle % (pp - 2):
                    continue
                sizes = [first] + [middle // (pp - 2)] * (pp - 2) + [last]
            cost = max(
                first_extra + first * layer_cost,
                last_extra + last * layer_cost,
                max(sizes[1:-1], default=0) * layer_cost,
            )
            if cost < best - 1e-15:
                best, best_sizes = cost, sizes
    assert best_sizes is not None
    return best_sizes
