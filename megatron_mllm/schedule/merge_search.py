"""The coreset look-ahead's merge, searched (`--coreset-lookahead-order searched`).

`lookahead.with_lookahead` places the next pool's forward by one shift of the pool's timeline
against the step's, the same on every rank. Here each rank's pool groups (a pool action and its
fills, in the pool's own order) may go anywhere between the step's groups: a local search over
those insertion points (runs of groups moved a little, or one group jumped anywhere between its
neighbours), seeded with a merge, scored by the simulator (a merge the validator
refuses scores nothing), accepted by simulated annealing with a fixed seed, so every rank that
runs it finds the same lists. `lookahead.with_searched_counts` runs one search per count of
pool micro-batches that go forward: the best place for 11 micro-batches is not the whole
pool's merge less its last five.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from megatron_mllm.schedule.actions import COMPUTE_KINDS, Action
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, backbone_groups, validate
from megatron_mllm.schedule.workload import Workload

# Merges scored per search: ~2 ms each at PP 2 with 8 + 11 micro-batches on this host.
SEARCH_EVALS = 3000
# The annealing's first temperature, as a fraction of the seed's step: a move that costs this
# much is accepted with probability 1/e at the start, never at the end.
START_TEMPERATURE = 0.004
# The share of moves that jump one pool group far (a bubble at the step's end is many step
# groups from where the seed puts the pool, past costly points in between).
JUMP_SHARE = 0.5


@dataclass
class _Lists:
    """One rank's merge as parts: leading gathers, the step's groups, the pool's groups."""

    lead: list[Action]
    step: list[list[Action]]
    pool: list[list[Action]]


def leading_gathers(acts: list[Action]) -> int:
    """How many parameter gathers open a rank's list (they stay first: pool forwards need them)."""
    return next((i for i, a in enumerate(acts) if a.kind != "AG"), len(acts))


def is_pool_action(action: Action, first_pool_mb: int) -> bool:
    """Whether `action` belongs to a look-ahead micro-batch (numbered from `first_pool_mb`)."""
    if action.kind in COMPUTE_KINDS:
        return action.mb >= first_pool_mb
    if action.kind in ("SEND", "RECV"):
        return TensorKey.parse(action.key).mb >= first_pool_mb
    return False


def _split(acts: list[Action], first_pool_mb: int) -> tuple[_Lists, list[int]]:
    """A merged rank list as its parts and each pool group's insertion point (the number of
    step groups before it)."""
    lead_n = leading_gathers(acts)
    parts, points = _Lists(list(acts[:lead_n]), [], []), []
    for group in backbone_groups(acts[lead_n:]):
        actions = [acts[lead_n + i] for i in group]
        if is_pool_action(actions[-1], first_pool_mb):
            parts.pool.append(actions)
            points.append(len(parts.step))
        else:
            parts.step.append(actions)
    return parts, points


def _joined(parts: _Lists, points: list[int]) -> list[Action]:
    out, j = list(parts.lead), 0
    for i in range(len(parts.step) + 1):
        while j < len(points) and points[j] == i:
            out += parts.pool[j]
            j += 1
        if i < len(parts.step):
            out += parts.step[i]
    return out


def _moved(points: list[list[int]], rng: random.Random, limits: list[int]) -> list[list[int]]:
    """A neighbour: a run of one to three of one rank's pool groups moved by up to three step
    groups, or (a share JUMP_SHARE of the moves) one group to any point between its
    neighbours' (the points kept in order)."""
    out = [list(p) for p in points]
    r = rng.randrange(len(out))
    if not out[r]:
        return out
    pts = out[r]
    j = rng.randrange(len(pts))
    if rng.random() < JUMP_SHARE:
        low = pts[j - 1] if j > 0 else 0
        high = pts[j + 1] if j + 1 < len(pts) else limits[r]
        pts[j] = rng.randint(low, high)
        return out
    run, delta = rng.randrange(1, 4), rng.choice((-3, -2, -1, 1, 2, 3))
    for k in range(j, min(j + run, len(pts))):
        pts[k] = max(0, min(limits[r], pts[k] + delta))
    pts.sort()
    return out


def _annealed(
    start: list[list[int]], score, limits: list[int], evals: int, rng: random.Random
) -> tuple[list[list[int]], float]:
    """The best insertion points `evals` annealing moves from `start` found, and their score."""
    current = best = start
    current_s = best_s = score(current)
    if not any(current):  # no pool groups to move
        return best, best_s
    temperature0 = START_TEMPERATURE * best_s
    for i in range(evals):
        candidate = _moved(current, rng, limits)
        seconds = score(candidate)
        temperature = temperature0 * (1 - i / evals)
        if seconds < current_s or (
            seconds < math.inf and rng.random() < math.exp(-(seconds - current_s) / temperature)
        ):
            current, current_s = candidate, seconds
            if seconds < best_s:
                best, best_s = candidate, seconds
    return best, best_s


def searched_merge(
    merged: Schedule, workload: Workload, evals: int = SEARCH_EVALS, seed: int = 0
) -> Schedule:
    """`merged` (a look-ahead schedule) with its pool groups moved where simulation with
    `workload` finds the step shortest (see the module docstring); each rank's step order and
    pool order are kept. Deterministic for a seed."""
    meta, first_pool = merged.meta, merged.meta.num_microbatches
    split = [_split(acts, first_pool) for acts in merged.ranks]
    parts = [s[0] for s in split]
    limits = [len(p.step) for p in parts]

    def built(points: list[list[int]]) -> Schedule:
        ranks = [_joined(p, q) for p, q in zip(parts, points, strict=True)]
        return Schedule(meta, ranks, merged.origin)

    scored: dict[tuple, float] = {}  # a move clamped or undone scores the same merge again

    def score(points: list[list[int]]) -> float:
        key = tuple(map(tuple, points))
        if key not in scored:
            candidate = built(points)
            try:
                validate(candidate)
            except ScheduleError:
                scored[key] = math.inf
            else:
                result = simulate(candidate, workload, keep_spans=False, classify=False)
                scored[key] = result.step_time_s
        return scored[key]

    best, best_s = _annealed([s[1] for s in split], score, limits, evals, random.Random(seed))
    out = built(best)
    if merged.lookahead_times is not None:
        out.lookahead_times = replace(merged.lookahead_times, step_s=best_s)
    return out
