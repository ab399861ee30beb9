"""One test per validator rule: each mutation of a valid schedule must be caught, with the rank,
the step and the rule named and the grid printed."""

import copy
from dataclasses import replace

import pytest

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.actions import AG, EB, EF, RECV, SEND, B, parse_action
from megatron_mllm.schedule.baselines import megatron_schedule
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.validator import ScheduleError, validate
from tests.conftest import tiny_job


@pytest.fixture
def megatron():
    schedule, _ = megatron_schedule(JobCosts(tiny_job(gpus=2, tp=1, pp=2)))
    validate(schedule)
    return schedule


@pytest.fixture
def optimus():
    job = tiny_job(gpus=4, tp=2, pp=2)
    schedule, _ = optimus_schedule(JobCosts(job), OptimusOptions(ParallelPlan(4, 1, 1)))
    validate(schedule)
    return schedule


def mutate(schedule: Schedule, fn) -> Schedule:
    ranks = copy.deepcopy(schedule.ranks)
    fn(ranks)
    return Schedule(schedule.meta, ranks)


def index(ranks, rank, text):
    return [str(a) for a in ranks[rank]].index(text)


def expect(schedule, rule, rank=None, step=None):
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    err = info.value
    assert err.rule == rule, err.summary
    if rank is not None:
        assert err.rank == rank, err.summary
    if step is not None:
        assert err.step == step, err.summary
    text = str(err)
    assert text.splitlines()[0] == err.summary
    assert f"rank {err.rank}, step {err.step}" in err.summary and f"[{rule}]" in err.summary
    assert "rank 0" in text.splitlines()[1]  # the grid's header
    return err


def test_valid_baseline_and_optimus_pass(megatron, optimus):
    validate(megatron)
    validate(optimus)


def test_unknown_action(megatron):
    expect(mutate(megatron, lambda r: r[0].insert(1, parse_action("F:s5v0m0"))), "unknown", 0, 1)


def test_wrong_rank(megatron):
    def fn(r):
        r[0].insert(1, r[1].pop(index(r, 1, "F:s1v0m0")))

    expect(mutate(megatron, fn), "wrong-rank", 0, 1)


def test_local_transfer(megatron):
    expect(mutate(megatron, lambda r: r[0].insert(3, SEND("eout.e0.m0"))), "local-transfer", 0, 3)


def test_duplicate(megatron):
    def fn(r):
        i = index(r, 0, "F:s0v0m1")
        r[0].insert(i + 1, r[0][i])

    expect(mutate(megatron, fn), "duplicate", 0)


def test_fill_must_precede_a_backbone_action(megatron):
    def fn(r):
        r[0].append(EF(0, 0, 0, 0, 0, 1, fill=0))

    expect(mutate(megatron, fn), "fill", 0, len(megatron.ranks[0]))


def test_fills_go_in_bubble_order():
    schedule, _ = megatron_schedule(JobCosts(tiny_job(gpus=2, tp=2, pp=1)))
    k = schedule.meta.encoders[0].fwd_kernels[0]
    assert k > 1

    def fn(r):
        i = index(r, 0, f"EF:e0p0s0m1k0-{k}")
        r[0][i : i + 1] = [EF(0, 0, 0, 1, 0, 1, fill=1), EF(0, 0, 0, 1, 1, k, fill=0)]

    expect(mutate(schedule, fn), "fill", 0)


def test_missing_backbone_action(megatron):
    expect(mutate(megatron, lambda r: r[1].pop(index(r, 1, "B:s1v0m3"))), "missing", 1)


def test_missing_all_gather(megatron):
    expect(mutate(megatron, lambda r: r[1].pop(index(r, 1, "AG:bb"))), "missing", 1)


def test_kernel_cover(optimus):
    def fn(r):
        for acts in r:
            for i, a in enumerate(acts):
                if a.kind == "EF" and a.k1 - a.k0 > 1:
                    acts[i] = replace(a, k1=a.k1 - 1)
                    return

    expect(mutate(optimus, fn), "kernel-cover")


def test_one_pipeline_per_microbatch(optimus):
    meta = optimus.meta
    enc = meta.encoders[0]
    mb_pipe = optimus.encoder_assignment()[0]
    mb, pipe = next(iter(mb_pipe.items()))
    other = next(p for p in range(enc.num_pipes) if p != pipe)
    ranks = copy.deepcopy(optimus.ranks)
    for acts in ranks:
        for i, a in enumerate(acts):
            if a.kind == "EB" and a.mb == mb and a.k0 == 0:
                acts.pop(i)
                home = enc.placement[other][a.stage][0]
                ranks[home].insert(1, EB(a.enc, other, a.stage, a.mb, a.k0, a.k1))
                expect(Schedule(meta, ranks), "pipe")
                return
    pytest.fail("no encoder backward found")


def test_unpaired_send(megatron):
    expect(mutate(megatron, lambda r: r[1].pop(index(r, 1, "RECV:act.s1v0.m2"))), "unpaired", 0)


def test_dependency_made_later(megatron):
    def fn(r):
        b = r[1].pop(index(r, 1, "B:s1v0m0"))
        r[1].insert(index(r, 1, "F:s1v0m0"), b)

    expect(mutate(megatron, fn), "order", 1)


def test_missing_recv(megatron):
    def fn(r):
        r[0].pop(index(r, 0, "SEND:act.s1v0.m1"))
        r[1].pop(index(r, 1, "RECV:act.s1v0.m1"))

    err = expect(mutate(megatron, fn), "order", 1)
    assert "no RECV:act.s1v0.m1" in err.summary


def test_encoder_output_before_backbone_stage0(megatron):
    """The encoder-to-backbone rule: F of stage 0 needs the encoder output of its micro-batch."""

    def fn(r):
        ef = r[0].pop(index(r, 0, "EF:e0p0s0m1k0-" + str(megatron.meta.encoders[0].fwd_kernels[0])))
        r[0].insert(index(r, 0, "F:s0v0m1") + 1, ef)

    err = expect(mutate(megatron, fn), "order", 0)
    assert "encoder output" in err.summary


def test_fill_cannot_feed_its_own_backbone_action(megatron):
    def fn(r):
        i = index(r, 0, "EF:e0p0s0m0k0-" + str(megatron.meta.encoders[0].fwd_kernels[0]))
        a = r[0][i]
        r[0][i] = EF(a.enc, a.pipe, a.stage, a.mb, a.k0, a.k1, fill=0)

    err = expect(mutate(megatron, fn), "order", 0)
    assert "same time" in err.summary


def test_deadlock(megatron):
    def fn(r):
        recv = r[0].pop(index(r, 0, "RECV:grad.s0v0.m0"))
        r[0].insert(index(r, 0, "F:s0v0m0") - 1, recv)

    err = expect(mutate(megatron, fn), "deadlock", 0)
    assert "rank 1" in err.summary  # every stuck rank is named


def test_backward_needs_its_gradient(megatron):
    """The backbone-to-encoder rule: encoder backward after backbone stage 0's backward."""
    k = megatron.meta.encoders[0].bwd_kernels[0]

    def fn(r):
        eb = r[0].pop(index(r, 0, f"EB:e0p0s0m0k0-{k}"))
        r[0].insert(index(r, 0, "B:s0v0m0"), eb)

    err = expect(mutate(megatron, fn), "order", 0)
    assert "gradient" in err.summary


def test_reduce_scatter_after_backward(megatron):
    def fn(r):
        rs = r[1].pop(len(r[1]) - 1)
        r[1].insert(1, rs)

    expect(mutate(megatron, fn), "order", 1, 1)


def test_grid_marks_the_step(megatron):
    err = expect(mutate(megatron, lambda r: r[0].insert(1, B(7, 0))), "unknown", 0, 1)
    assert ">B:s7v0m0<" in str(err)
    assert AG("bb") in megatron.ranks[0] and RECV("act.s1v0.m0") in megatron.ranks[1]
