"""Coreset look-ahead: the next step's pool goes forward in this step's bubbles.

A coreset step first sends its pool of r x B samples forward without gradients, then trains on
the B it selects. With look-ahead, step t's lists also carry the forward half of step t+1's
pool (`ScheduleMeta.lookahead` micro-batches, numbered after the step's own), so that pool
work fills step t's pipeline bubbles (and the pool pass loses its own fill and drain); step
t+1's selection then uses step t's parameters.

Where the pool's actions go: both timelines are simulated on their own, the pool's is shifted
against the step's, and each rank's two lists are merged in time order, each keeping its own
order. Shifts run from "the whole pool first" to "the whole pool last"; the validator checks
every candidate (a merge can deadlock where the two timelines disagree) and the fastest valid
one in simulation is kept (`--coreset-lookahead-order simulated`, the default), or the whole
pool first without a search (`pool-first`). `searched` goes on from the shift merge: each
rank's pool groups moved on their own (`merge_search.py`), once for the whole pool and once
for each count of pool micro-batches that can go forward (`with_searched_counts`). Measured on
our executor at PP 2: searched no slower than pool-first, the shift merge the slowest; at PP 8
the simulator predicts the interleaves far ahead of pool-first (docs/performance.md).
`with_fewer_ahead` gives a merge's lists for its first k pool micro-batches (only the rows the
selection scores go forward): the searched ones where there are, else the merge trimmed.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import COMPUTE_KINDS, Action
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.merge_search import (
    SEARCH_EVALS,
    is_pool_action,
    leading_gathers,
    searched_merge,
)
from megatron_mllm.schedule.schedule import LookaheadTimes, Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, backbone_groups, validate
from megatron_mllm.schedule.workload import Workload

# --coreset-lookahead-order -> the shifts `with_lookahead` tries (0: the whole pool first);
# "searched" then moves each rank's pool groups on their own (`merge_search.py`).
SHIFTS = {"simulated": 12, "pool-first": 0, "searched": 12}

# The simulator without spans or idle causes (only step times are read here).
_QUICK = {"keep_spans": False, "classify": False}

# Keys whose messages carry activations forward (the rest belong to the backward).
FORWARD_KEYS = ("act", "eout", "eact")


def renumbered(action: Action, offset: int) -> Action:
    """`action` with its micro-batch (or its message key's) moved up by `offset`."""
    if action.kind in COMPUTE_KINDS:
        return replace(action, mb=action.mb + offset)
    if action.kind in ("SEND", "RECV"):
        k = TensorKey.parse(action.key)
        moved = TensorKey(k.kind, k.enc, k.stage, k.chunk, k.mb + offset, k.k)
        return replace(action, key=str(moved))
    return action


def forward_half(pool: Schedule, offset: int) -> list[list[Action]]:
    """Each rank's forward work of `pool` (F, EF and the messages that carry activations), in
    its order, micro-batches numbered from `offset`. An encoder forward that filled a TP bubble
    of a backward keeps its place as a plain action."""
    out = []
    for acts in pool.ranks:
        kept: list[Action] = []
        for group in backbone_groups(acts):
            main = acts[group[-1]]
            fills = [acts[i] for i in group[:-1] if acts[i].kind == "EF"]
            if main.kind == "F":
                kept += [*fills, main]
            elif main.kind == "B":
                kept += [replace(f, fill=None) for f in fills]
            elif main.kind == "EF":
                kept.append(main)
            elif main.kind in ("SEND", "RECV"):
                if TensorKey.parse(main.key).kind in FORWARD_KEYS:
                    kept.append(main)
        out.append([renumbered(a, offset) for a in kept])
    return out


def _check_alike(step: Schedule, pool: Schedule) -> None:
    a, b = step.meta, pool.meta
    same = (a.pp, a.vpp, a.slots, a.encoders, a.backbone_layers)
    if same != (b.pp, b.vpp, b.slots, b.encoders, b.backbone_layers) or step.meta.lookahead:
        raise ConfigError(
            "the coreset pool's schedule must be for the step's own modules and placement "
            f"(PP {b.pp} VPP {b.vpp}, layers {list(b.backbone_layers)} against PP {a.pp} "
            f"VPP {a.vpp}, layers {list(a.backbone_layers)})"
        )


def _groups(acts: list[Action], first: int = 0) -> list[list[int]]:
    """Execution groups (a backbone action and its fills) from index `first` on."""
    return [[first + i for i in g] for g in backbone_groups(acts[first:])]


def _timed(acts: list[Action], first: int, times: dict, r: int) -> list[tuple[float, list]]:
    """Rank `r`'s execution groups from index `first` on, each with its simulated start, made
    non-decreasing along the list (so a merge by time keeps the list's order)."""
    groups = _groups(acts, first)
    starts = accumulate((min(times[(r, i)][0] for i in g) for g in groups), max)
    return [(t, [acts[i] for i in g]) for t, g in zip(starts, groups, strict=True)]


def _merged(step: Schedule, meta, timed: list, shift: float) -> Schedule:
    """Each rank's step groups and pool groups (`timed`: per rank, both with their starts)
    merged in time order, the pool's times shifted by `shift` (ties go to the step), after the
    step's leading gathers."""
    ranks = []
    for acts, (mine, theirs) in zip(step.ranks, timed, strict=True):
        out, i, j = list(acts[: leading_gathers(acts)]), 0, 0
        while i < len(mine) or j < len(theirs):
            if j == len(theirs) or (i < len(mine) and mine[i][0] <= theirs[j][0] + shift):
                out += mine[i][1]
                i += 1
            else:
                out += theirs[j][1]
                j += 1
        ranks.append(out)
    return Schedule(meta, ranks, step.origin)


def _pool_first(step: Schedule, ahead: list[list[Action]], meta) -> Schedule:
    """The whole pool first on every rank (after the gathers): the pool's own timeline."""
    ranks = []
    for acts, extra in zip(step.ranks, ahead, strict=True):
        lead = leading_gathers(acts)
        ranks.append(acts[:lead] + extra + acts[lead:])
    return Schedule(meta, ranks, step.origin)


def with_lookahead(
    step: Schedule, pool: Schedule, workload: Workload, shifts: int = 12
) -> Schedule:
    """`step` with the forward half of `pool` (the next step's coreset pool) merged into its
    lists where simulation with `workload` finds it costs least (see the module docstring);
    `shifts=0`: the whole pool first, not interleaved. Its `lookahead_times` hold the predicted
    step time and the step's and the pool's alone."""
    _check_alike(step, pool)
    meta = replace(step.meta, lookahead=pool.meta.num_microbatches)
    ahead = forward_half(pool, step.meta.num_microbatches)
    best = _pool_first(step, ahead, meta)
    validate(best)
    first, alone = simulate(best, workload, **_QUICK), simulate(step, workload, **_QUICK)
    leads = [leading_gathers(acts) for acts in step.ranks]
    pool_end = max(
        (
            first.action_times[(r, leads[r] + i)][1]
            for r, a in enumerate(ahead)
            for i in range(len(a))
        ),
        default=0.0,
    )
    timed = [  # per rank: (the step's groups, the pool's groups), each with its start
        (
            _timed(acts, leads[r], alone.action_times, r),
            _timed(best.ranks[r], leads[r], first.action_times, r)[: len(_groups(ahead[r]))],
        )
        for r, acts in enumerate(step.ranks)
    ]
    best_time, span = first.step_time_s, pool_end + alone.step_time_s
    for j in range(shifts + 1 if shifts else 0):
        candidate = _merged(step, meta, timed, -pool_end + span * j / shifts)
        try:
            validate(candidate)
        except ScheduleError:
            continue
        t = simulate(candidate, workload, **_QUICK).step_time_s
        if t < best_time - 1e-12:
            best, best_time = candidate, t
    best.lookahead_times = LookaheadTimes(best_time, alone.step_time_s, pool_end)
    return best


def with_fewer_ahead(merged: Schedule, keep: int) -> Schedule:
    """`merged` (a look-ahead schedule) going forward with only its first `keep` look-ahead
    micro-batches: the lists searched for that count where `merged` holds them
    (`with_searched_counts`), else every other one's actions dropped, each rank's order
    otherwise unchanged (look-ahead micro-batches are forward-only and independent of each
    other). Its `lookahead_times` are the whole pool's."""
    meta = merged.meta
    if not 0 <= keep <= meta.lookahead:
        raise ConfigError(f"{keep} look-ahead micro-batches: the merge holds {meta.lookahead}")
    if keep in merged.fewer_ahead:
        return merged.fewer_ahead[keep]
    last = meta.num_microbatches + keep
    ranks = [[a for a in acts if not is_pool_action(a, last)] for acts in merged.ranks]
    out = Schedule(replace(meta, lookahead=keep), ranks)
    out.origin, out.lookahead_times = merged.origin, merged.lookahead_times
    validate(out)
    return out


def with_searched_counts(
    merged: Schedule, workload: Workload, counts: range, evals: int = SEARCH_EVALS
) -> Schedule:
    """`merged` searched for the whole pool (`merge_search.searched_merge`), holding a merge
    searched on its own for each of `counts` pool micro-batches going forward
    (`Schedule.fewer_ahead`, which `with_fewer_ahead` returns)."""
    out = searched_merge(merged, workload, evals)
    for k in (k for k in counts if 0 < k < merged.meta.lookahead):
        seeds = (with_fewer_ahead(merged, k), with_fewer_ahead(out, k))
        seed = min(seeds, key=lambda s: simulate(s, workload, **_QUICK).step_time_s)
        out.fewer_ahead[k] = searched_merge(seed, workload, evals)
        out.fewer_ahead[k].lookahead_times = out.lookahead_times
    return out


def lookahead_merge(
    step: Schedule, pool: Schedule, workload: Workload, order: str, counts: range = range(0)
) -> Schedule:
    """The look-ahead schedule for --coreset-lookahead-order `order`; "searched" also searches
    each of `counts` pool micro-batches going forward."""
    merged = with_lookahead(step, pool, workload, SHIFTS[order])
    return with_searched_counts(merged, workload, counts) if order == "searched" else merged
