"""The backbone's backward split where a pipeline peer waits for it (zero-bubble's B / W).

In 1F1B the stages before the last wait through the warm-up for the last stage's first input
gradient, and the drain waits for every stage's last one. Splitting those backwards into B (the
input gradient, sent at once) and W (the weight gradients) lets the peer start sooner; each W
then runs in a bubble after its B. `backbone_wgrad_points` names the split backwards; Optimus
places their W's among the encoder's work (`bubble_scheduler`), and `with_backbone_wgrad` puts
them into any other schedule's lists (the Megatron baseline's, for a like-for-like ablation).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import Action, W
from megatron_mllm.schedule.schedule import Schedule, ScheduleMeta
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.workload import Workload

Point = tuple[int, int, int]  # (stage, chunk, micro-batch) of a split backward


def check_backbone_tp(tp: int) -> None:
    """The deferred linears run their input gradient's TP all-reduce outside the collectives
    TP-bubble fills overlap, so a split backbone backward is planned for TP 1 only."""
    if tp > 1:
        raise ConfigError(
            f"a split backbone backward runs at backbone TP 1 (got TP {tp}): its input "
            "gradient's all-reduce would not host TP-bubble fills; plan without the split"
        )


def backbone_wgrad_points(meta: ScheduleMeta) -> tuple[Point, ...]:
    """The split backwards: the last stage's first micro-batch, whose input gradient ends
    1F1B's warm-up on the stages before it, and every stage's last, whose input gradient the
    drain waits for."""
    if meta.vpp > 1 or meta.slots > 1 or meta.pp < 2:
        raise ConfigError(
            f"a split backbone backward needs PP >= 2, no virtual stages and the encoder's TP "
            f"equal to the backbone's (got PP {meta.pp}, VPP {meta.vpp}, {meta.slots} encoder "
            "slots per rank); plan without it"
        )
    last = meta.num_microbatches - 1
    points = {(meta.pp - 1, 0, 0)} | {(s, 0, last) for s in range(meta.pp)}
    return tuple(sorted(points))


def with_backbone_wgrad(schedule: Schedule, workload: Workload) -> Schedule:
    """`schedule` with its backbone backwards split at `backbone_wgrad_points`: each W after
    the compute action that ends the first idle stretch after its B long enough to hold it
    (and after the sends that follow that action), else before the rank's RS of the backbone;
    simulated again after each W is placed."""
    meta = replace(schedule.meta, backbone_wgrad=backbone_wgrad_points(schedule.meta))
    ranks = [list(acts) for acts in schedule.ranks]
    for point in meta.backbone_wgrad:
        stage, chunk, mb = point
        sim = simulate(Schedule(meta, ranks), workload)
        w = W(stage, mb, chunk)
        seconds = sum(k.compute_s for k in workload.kernels("W", stage, chunk, mb=mb))
        ranks[stage].insert(_place(ranks[stage], stage, sim.action_times, point, seconds), w)
    out = Schedule(meta, ranks)
    out.origin = schedule.origin
    return out


def _place(acts: list[Action], rank: int, times: dict, point: Point, seconds: float) -> int:
    """Where W of `point` goes in `acts`: see `with_backbone_wgrad`."""
    stage, chunk, mb = point
    computes = [i for i, a in enumerate(acts) if a.is_compute]
    b = next(i for i in computes if (acts[i].kind, acts[i].stage, acts[i].chunk, acts[i].mb)
             == ("B", stage, chunk, mb))  # fmt: skip
    after = [i for i in computes if i >= b]
    for i, j in zip(after, after[1:], strict=False):
        if times[(rank, j)][0] - times[(rank, i)][1] >= seconds:
            return _past_sends(acts, i)
    return next(i for i, a in enumerate(acts) if a.kind == "RS" and a.key == "bb")


def _past_sends(acts: list[Action], i: int) -> int:
    """The index just past action `i` and the sends right after it."""
    i += 1
    while i < len(acts) and acts[i].kind == "SEND":
        i += 1
    return i
