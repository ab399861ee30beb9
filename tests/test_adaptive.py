"""Data-aware Optimus in the schedule core: text-only micro-batches without encoder actions,
the cost-balanced assignment, per-step plans never slower than the static one, and the cache."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import BENCH
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.planning.schedules import job_of
from megatron_mllm.schedule.actions import EF
from megatron_mllm.schedule.adaptive import AdaptivePlanner, timed_step
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import optimus_schedule
from megatron_mllm.schedule.loads import (
    balanced_assignment,
    heaviest,
    load_samples,
    loader_assignment,
)
from megatron_mllm.schedule.planner import plan_optimus
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, validate

DP, MB, N = 2, 2, 6  # 24 samples a step
GLOBAL = DP * MB * N


@pytest.fixture(scope="module")
def static():
    costs = JobCosts(job_of(BENCH, ParallelPlan(DP, 1, 2), MB, N))
    best, _, _ = plan_optimus(costs, encoder_plan=ParallelPlan(2 * DP, 1, 1))
    return costs, best


def test_a_text_only_micro_batch_has_no_encoder_actions_and_validates(static):
    costs, best = static
    loads = (1.0, 0.0, 2.0, 0.0, 1.0, 0.5)
    schedule, wl = optimus_schedule(costs, best.options, {}, loads)
    assert schedule.meta.text_only == (1, 3)
    enc_mbs = {a.mb for acts in schedule.ranks for a in acts if a.kind in ("EF", "EB")}
    assert enc_mbs == {0, 2, 4, 5}
    assert not any("eout.e0.m1" in getattr(a, "key", "") for acts in schedule.ranks for a in acts)
    validate(schedule)
    again = Schedule.from_csv(schedule.to_csv())
    assert again.meta.text_only == (1, 3)
    validate(again)
    kept, _ = optimus_schedule(costs, best.options, {}, loads, skip_text_only=False)
    assert simulate(schedule, wl).step_time_s <= simulate(kept, wl).step_time_s + 1e-12
    # Encoder work for a text-only micro-batch is refused, naming the rule.
    rank = next(r for r, acts in enumerate(schedule.ranks) if any(a.kind == "EF" for a in acts))
    bad = Schedule(schedule.meta, [list(acts) for acts in schedule.ranks])
    bad.ranks[rank].insert(1, EF(0, 0, 0, 1, 0, 1))
    with pytest.raises(ScheduleError, match=r"\[text-only\] micro-batch 1 has no image"):
        validate(bad)


def test_the_balanced_assignment_keeps_the_global_batch_and_evens_the_replicas():
    counts = [8, 0, 0, 0, 4, 4, 0, 1, 1, 1, 2, 0] * 2
    loader = loader_assignment(len(counts), DP, MB)
    balanced = balanced_assignment(counts, DP, MB)
    for assignment in (loader, balanced):
        flat = [i for replica in assignment for mb in replica for i in mb]
        assert sorted(flat) == list(range(len(counts)))  # every sample once: the same batch
        assert all(len(replica) == N and all(len(mb) == MB for mb in replica)
                   for replica in assignment)  # fmt: skip

    def totals(assignment):
        return [sum(counts[i] for mb in replica for i in mb) for replica in assignment]

    assert max(totals(balanced)) - min(totals(balanced)) <= max(counts)
    mb_loads = [sum(counts[i] for i in mb) for replica in balanced for mb in replica]
    assert max(mb_loads) - min(mb_loads) <= max(counts)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 1, 2, 4, 8]), min_size=GLOBAL, max_size=GLOBAL))
def test_the_adaptive_plan_is_never_slower_than_the_static_one(static, counts):
    costs, best = static
    planner = AdaptivePlanner(costs, best)
    plan = planner.plan(counts)
    loader = loader_assignment(GLOBAL, DP, MB)
    _, static_sim = timed_step(best.schedule, best.workload, counts, loader, 1.0)
    assert plan.step_time_s <= static_sim.step_time_s
    validate(plan.schedule)
    # The plan's own time is its schedule's on its heaviest replica's loads in slot order.
    replica = plan.assignment[heaviest(counts, plan.assignment)]
    loads = tuple(sum(counts[i] for i in mb) / MB for mb in replica)
    assert plan.workload.encoder_load == loads
    assert simulate(plan.schedule, plan.workload).step_time_s == pytest.approx(plan.step_time_s)


def test_an_uneven_step_gets_a_strictly_faster_plan(static):
    costs, best = static
    counts = [4] * (GLOBAL // 2) + [0] * (GLOBAL // 2)  # replica 0 has every image
    plan = AdaptivePlanner(costs, best).plan(counts)
    loader = loader_assignment(GLOBAL, DP, MB)
    _, static_sim = timed_step(best.schedule, best.workload, counts, loader, 1.0)
    assert plan.step_time_s < 0.95 * static_sim.step_time_s and plan.candidate != "static"


def test_a_repeated_multiset_of_counts_hits_the_cache(static):
    """Counts uneven enough that the static plan loses (replica 0 holds every image), then the
    same multiset shuffled: the second is a cache hit with the first's schedule, an assignment
    of every sample once, and the same per-replica totals."""
    costs, best = static
    planner = AdaptivePlanner(costs, best)
    counts = [4] * (GLOBAL // 2) + [0] * (GLOBAL // 2)
    first = planner.plan(counts)
    assert first.candidate != "static"
    shuffled = counts[1:] + counts[:1]
    second = planner.plan(shuffled)
    assert (planner.hits, planner.misses) == (1, 1)
    assert second.schedule is first.schedule

    def totals(c, assignment):
        return sorted(sum(c[i] for mb in replica for i in mb) for replica in assignment)

    flat = sorted(i for replica in second.assignment for mb in replica for i in mb)
    assert flat == list(range(GLOBAL))
    assert totals(shuffled, second.assignment) == totals(counts, first.assignment)
    assert len(planner.seconds) == 2 and all(s > 0 for s in planner.seconds)


def test_a_load_file_for_another_global_batch_is_refused(tmp_path):
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"global_batch": 8, "steps": [[1] * 8]}))
    assert load_samples(str(path), 8) == [[1] * 8]
    with pytest.raises(ConfigError, match="global batch of 8 samples, the job's is 16"):
        load_samples(str(path), 16)
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not JSON of the form"):
        load_samples(str(path), 8)
    with pytest.raises(ConfigError, match="no such file"):
        load_samples(str(tmp_path / "missing.json"), 8)


def test_plan_schedule_reads_a_load_file(tmp_path, run_tool):
    steps = [[0, 1, 2, 4] * 8, [1] * 32]
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"global_batch": 32, "steps": steps}))
    args = ["--encoder", "vit-3b", "--backbone", "gpt-11b", "--gpus", "16", "--tp", "2",
            "--pp", "4", "--global-batch", "32", "--seq-len", "1024"]  # fmt: skip
    out = run_tool("plan_schedule.py", *args, "--encoder-loads", str(path), "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["sample_steps"] == 2 and got["images_per_sample"] == pytest.approx(1.375)
    bad = run_tool("plan_schedule.py", *args[:-3], "64", "--seq-len", "1024",
                   "--encoder-loads", str(path))  # fmt: skip
    assert bad.returncode == 2 and "the job's is 64" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_plan_not_ready_in_time_falls_back_to_the_static_schedule(tmp_path):
    """The per-step planner: a plan still running when its step starts is not waited for (the
    static schedule runs, counted); a failed plan falls back too; a ready one is used."""
    import threading

    import torch.distributed as dist

    from megatron_mllm.runtime.planning.step_plans import StepPlanner

    release = threading.Event()

    class Planner:
        seconds: list = []

        def plan(self, counts):
            if counts == "slow":
                release.wait(10)
            if counts == "bad":
                raise ValueError("no plan")
            return counts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        planner = StepPlanner(Planner(), dist.group.WORLD)
        assert planner.take(0) is None  # nothing was requested for the first step
        planner.request(1, "slow")
        assert planner.take(1) is None and planner.stats.fallbacks == 1
        release.set()
        planner.request(2, "bad")
        planner._pending[2].exception()  # wait for it to fail
        assert planner.take(2) is None and planner.stats.fallbacks == 2
        assert planner.stats.failures == ["step 2: no plan"]
        planner.request(3, "ready")
        planner._pending[3].result()
        assert planner.take(3) == "ready" and planner.stats.planned == 1
        assert "1 planned, 2 static fallback(s)" in planner.stats.line([0.01])
        planner.close()
        in_step = StepPlanner(Planner(), dist.group.WORLD, in_step=True)  # planned when asked
        in_step.request(1, "ready")
        in_step.request(2, "bad")
        assert in_step.take(1) == "ready" and in_step.take(2) is None
        assert in_step.stats.failures == ["step 2: no plan"] and in_step.stats.planned == 1
        in_step.close()
    finally:
        dist.destroy_process_group()


def test_loads_within_a_bucket_share_a_plan(static):
    """A native tower's loads (nominal images by patches) are not whole: loads that differ by
    less than a bucket (1 / BUCKETS of an image) hit the plan of the first; another bucket
    does not."""
    from megatron_mllm.schedule.adaptive import BUCKETS

    costs, best = static
    planner = AdaptivePlanner(costs, best)
    loads = [4.02] * (GLOBAL // 2) + [0.0] * (GLOBAL // 2)
    planner.plan(loads)
    planner.plan([x + 0.03 if x else x for x in loads][::-1])
    assert (planner.hits, planner.misses) == (1, 1)
    planner.plan([x + 1.0 / BUCKETS if x else x for x in loads])
    assert (planner.hits, planner.misses) == (1, 2)
