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


def first_last_split(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers per stage as megatron-core builds them (the stages other than a given first or
    last one hold equal shares): Megatron's --decoder-first/last-pipeline-num-layers, or with
    neither the even split, else the one closest to even (first and last take the remainder).
    ConfigError if no such split exists."""
    if pp == 1:
        return [num_layers]
    if first is None and last is None and num_layers % pp == 0:
        return [num_layers // pp] * pp
    options = []
    for f in range(1, num_layers) if first is None else [first]:
        for la in range(1, num_layers - f + 1) if last is None else [last]:
            sizes = _with_even_middle(num_layers, pp, f, la, _free_side(first, last))
            if sizes:
                options.append(sizes)
    if not options:
        given = (
            f" (first stage {first}, last stage {last})" if (first, last) != (None, None) else ""
        )
        raise ConfigError(
            f"--num-layers {num_layers} cannot be split over PP {pp} stages{given}: the other "
            "stages need equal shares; give --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers that leave them divisible"
        )
    return min(options, key=lambda sizes: (max(sizes) - min(sizes), sizes[0]))


def _free_side(first: int | None, last: int | None) -> str:
    """Which side Megatron treats as an even stage: the one not given when the other is."""
    if (first is None) == (last is None):
        return ""
    return "first" if first is None else "last"


def _with_even_middle(n: int, pp: int, first: int, last: int, free: str) -> list[int]:
    """[first, middle..., last] with equal middle stages, or [] if they cannot be equal.
    With one side given and the other `free` ("first" or "last"), Megatron spreads the rest
    over the other pp - 1 stages: the free side is one of them."""
    middle = n - first - last
    if pp == 2:
        return [first, last] if middle == 0 else []
    if middle < pp - 2 or middle % (pp - 2):
        return []
    share = middle // (pp - 2)
    if (free == "last" and last != share) or (free == "first" and first != share):
        return []
    return [first, *[share] * (pp - 2), last]


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
