import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mllm.schedule.actions import AG, RS
from megatron_mllm.schedule.cost_model import Kernel
from megatron_mllm.schedule.partition import balanced_partition, megatron_split
from megatron_mllm.schedule.pipeline_orders import backbone_actions, backbone_orders
from megatron_mllm.schedule.schedule import ScheduleMeta
from megatron_mllm.schedule.simulator import DeadlockError, simulate
from megatron_mllm.schedule.transfers import add_transfers
from megatron_mllm.schedule.validator import validate
from megatron_mllm.schedule.workload import Workload


def uniform(pp: int, vpp: int, m: int, tf: float = 1.0, tb: float = 2.0, act: float = 1.0):
    meta = ScheduleMeta(pp=pp, vpp=vpp, num_microbatches=m)
    stages = [(s, v) for s in range(pp) for v in range(vpp)]
    wl = Workload(
        backbone_fwd={k: [Kernel("f", tf / vpp)] for k in stages},
        backbone_bwd={k: [Kernel("b", tb / vpp)] for k in stages},
        backbone_act_bytes={k: act for k in stages},
    )
    ranks = [
        [AG("bb"), *backbone_actions(r, o), RS("bb")] for r, o in enumerate(backbone_orders(meta))
    ]
    schedule = add_transfers(meta, ranks)
    validate(schedule)
    return schedule, wl


@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (4, 8), (4, 3), (8, 16), (3, 5)])
def test_1f1b_bubble_matches_closed_form(pp, m):
    schedule, wl = uniform(pp, 1, m)
    res = simulate(schedule, wl)
    assert res.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert res.step_time_s == pytest.approx((m + pp - 1) * 3.0)
    assert res.limit_s == pytest.approx(m * 3.0)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 6)])
def test_interleaved_bubble_matches_closed_form(pp, vpp, m):
    schedule, wl = uniform(pp, vpp, m)
    res = simulate(schedule, wl)
    assert res.bubble_ratio == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-12)


def test_1f1b_keeps_pp_microbatches_alive_on_stage0():
    schedule, wl = uniform(4, 1, 8)
    assert simulate(schedule, wl).peak_memory_bytes == pytest.approx(4.0)


def test_bubble_causes_add_up():
    schedule, wl = uniform(4, 1, 6)
    res = simulate(schedule, wl)
    assert sum(res.bubbles_s.values()) == pytest.approx(res.bubble_ratio * res.step_time_s)
    assert res.bubbles_s["pp_warmup"] > 0 and res.bubbles_s["pp_cooldown"] > 0
    # 1F1B, uniform stages (tf=1, tb=2, p=4): every rank idles (p-1)(tf+tb) in all; rank r
    # waits r forwards before its first one.
    for r, causes in enumerate(res.bubbles_by_rank_s):
        assert sum(causes.values()) == pytest.approx(3 * 3.0)
        assert causes["pp_warmup"] == pytest.approx(r * 1.0)


def test_a_send_departs_when_its_stream_reaches_it():
    """A SEND placed after later compute departs once that compute ends, not when its tensor
    was made: NCCL's stream waits for the work queued before the send (and our CPU executor
    runs the list in order). 1F1B PP=2 with rank 0's first send moved after its second F:
    rank 1 starts one forward later, and so does the whole step."""
    schedule, wl = uniform(2, 1, 4)
    before = simulate(schedule, wl).step_time_s
    r0 = schedule.ranks[0]
    send = r0.pop([str(a) for a in r0].index("SEND:act.s1v0.m0"))
    r0.insert([str(a) for a in r0].index("F:s0v0m1") + 1, send)
    validate(schedule)
    res = simulate(schedule, wl)
    names = [str(a) for a in r0]
    f1_end = res.action_times[(0, names.index("F:s0v0m1"))][1]
    assert res.action_times[(0, names.index("SEND:act.s1v0.m0"))][0] == pytest.approx(f1_end)
    assert res.step_time_s == pytest.approx(before + 1.0)


def test_simulator_detects_deadlock():
    schedule, wl = uniform(2, 1, 2)
    r0 = schedule.ranks[0]
    recv = r0.pop([str(a) for a in r0].index("RECV:grad.s0v0.m0"))
    r0.insert(1, recv)
    with pytest.raises(DeadlockError, match="rank 0"):
        simulate(schedule, wl)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=9), st.integers(1, 4))
def test_balanced_partition_is_optimal(costs, parts):
    parts = min(parts, len(costs))
    sizes = balanced_partition(costs, parts)
    assert sum(sizes) == len(costs) and all(s > 0 for s in sizes)

    def worst(sz):
        out, i = 0.0, 0
        for n in sz:
            out = max(out, sum(costs[i : i + n]))
            i += n
        return out

    best = min(
        worst([b - a for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=False)])
        for cuts in itertools.combinations(range(1, len(costs)), parts - 1)
    )
    assert worst(sizes) == pytest.approx(best)


@pytest.mark.parametrize("layers,pp,first_extra", [(96, 8, 15.0), (12, 4, 0.0), (10, 2, 3.0)])
def test_megatron_split_uses_first_and_last_knobs_only(layers, pp, first_extra):
    sizes = megatron_split(layers, pp, 1, 1.0, first_extra, 0.3)
    assert sum(sizes) == layers and len(sizes) == pp
    assert len(set(sizes[1:-1])) <= 1  # the middle stages are even
    if first_extra > 0:
        assert sizes[0] <= sizes[-1] or pp == 2


def test_bucketed_reduce_scatter_overlaps_the_last_backward():
    """A part's RS in K buckets starts when the first 1/K of its last backward is done and
    ends 1/K of its time after that backward (when the DP stream keeps up); one bucket waits
    for the whole backward."""
    meta = ScheduleMeta(pp=1, vpp=1, num_microbatches=2)
    acts = [AG("bb"), *backbone_actions(0, backbone_orders(meta)[0]), RS("bb")]
    sched = add_transfers(meta, [acts])
    validate(sched)

    def run(buckets: int, rs: float) -> float:
        wl = Workload(
            backbone_fwd={(0, 0): [Kernel("f", 1.0)]},
            backbone_bwd={(0, 0): [Kernel("b", 2.0)]},
            dp_s={(0, "RS", "bb"): rs},
            dp_buckets={(0, "bb"): buckets},
        )
        return simulate(sched, wl).step_time_s

    compute = 2 * (1.0 + 2.0)
    assert run(1, 0.4) == pytest.approx(compute + 0.4)
    assert run(4, 0.4) == pytest.approx(compute + 0.1)  # 0.1 s per bucket, each in time
    assert run(4, 8.0) == pytest.approx(compute - 2.0 + 0.5 + 8.0)  # the DP stream limits


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (4, 1, 8), (2, 2, 4), (4, 3, 8)])
def test_chunk_overhead_is_paid_once_per_backbone_action_and_interleaving_multiplies_it(pp, vpp, m):
    schedule, wl = uniform(pp, vpp, m)
    wl.chunk_overhead_s = 0.25
    res = simulate(schedule, wl)
    assert res.step_time_s == pytest.approx((vpp * m + pp - 1) * (3.0 / vpp + 2 * 0.25))
    assert res.limit_s == pytest.approx(m * 3.0)  # the bound counts kernels only


def test_the_profiles_chunk_overhead_reaches_analytic_workloads_only():
    from dataclasses import replace

    from conftest import tiny_job

    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts

    job = tiny_job()
    job = replace(job, hw=job.hw.with_chunk_overhead(1e-3))
    assert megatron_schedule(JobCosts(job))[1].chunk_overhead_s == 1e-3
    measured = {job.backbone.name: {"forward": {"layer": 1e-3}, "backward": {"layer": 2e-3}}}
    assert megatron_schedule(JobCosts(job, measured, unit="layer"))[1].chunk_overhead_s == 0.0
