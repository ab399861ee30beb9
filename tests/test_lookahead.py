"""Coreset look-ahead (--coreset-lookahead): the next step's pool goes forward in this step's
bubbles. The IR (forward-only look-ahead micro-batches through validator and simulator), the
merge, and at run time: selection with the step's own weights (checked against a saved copy)
and training that is unchanged by the pool work merged into it. And the pool pass of either
mode: only the rows the selection scores go forward."""

import copy
import warnings
from dataclasses import replace

import pytest
import torch

from megatron_mllm.data.coreset import CoresetConfig, CoresetSelector
from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.engine.program import gpu_program
from megatron_mllm.runtime.job import (
    Collect,
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
    check_job,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.planning.schedules import pool_plan, runtime_plan
from megatron_mllm.schedule.actions import B, F
from megatron_mllm.schedule.lookahead import (
    lookahead_merge,
    with_fewer_ahead,
    with_lookahead,
    with_searched_counts,
)
from megatron_mllm.schedule.merge_search import is_pool_action, searched_merge
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import ScheduleError, validate

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
N, POOL = 4, 8  # the step's micro-batches (of 1) and the pool's (ratio 2)
PLAN = ParallelPlan(1, 1, 2)


def schedules(name: str, n: int = N, pool: int = POOL):
    """(step schedule, its workload, the pool's forward-only schedule) for the tiny MLLM."""
    step, workload = runtime_plan(TINY, PLAN, 1, n, name)
    return step, workload, pool_plan(step, TINY, PLAN, 1, pool)[0]


@pytest.mark.parametrize("name", ["optimus", "megatron"])
def test_the_merged_step_is_valid_forward_only_and_faster_than_one_after_the_other(name):
    step, workload, pool = schedules(name)
    merged = with_lookahead(step, pool, workload)
    validate(merged)
    meta = merged.meta
    assert (meta.num_microbatches, meta.lookahead, meta.total_microbatches) == (N, POOL, N + POOL)
    acts = [a for rank in merged.ranks for a in rank]
    ahead = {a.mb for a in acts if a.kind in ("F", "EF") and a.mb >= N}
    assert ahead == set(range(N, N + POOL))  # every pool micro-batch goes forward
    assert not [a for a in acts if a.kind in ("B", "EB") and a.mb >= N]
    assert not [a for a in acts if a.kind in ("SEND", "RECV") and a.key.startswith(("grad", "eg"))
                and int(a.key.rsplit(".m", 1)[1]) >= N]  # fmt: skip
    # The step's own actions keep their order on every rank.
    for before, after in zip(step.ranks, merged.ranks, strict=True):
        assert [a for a in after if a in set(before)] == before
    got = simulate(merged, workload).step_time_s
    assert got == pytest.approx(merged.lookahead_times.step_s)
    # Faster than the step and the pool's pass one after the other, each simulated here.
    alone = simulate(step, workload).step_time_s
    pool_alone = simulate(*pool_plan(step, TINY, PLAN, 1, POOL)).step_time_s
    assert alone < got < alone + pool_alone  # the pool's work costs, but its bubbles are filled
    assert Schedule.from_csv(merged.to_csv()).meta == meta  # the metadata round-trips


def test_shifts_zero_keeps_the_whole_pool_first_on_every_rank():
    step, workload, pool = schedules("optimus")
    first = with_lookahead(step, pool, workload, shifts=0)
    validate(first)
    for before, after in zip(step.ranks, first.ranks, strict=True):
        lead = next(i for i, a in enumerate(after) if a.kind != "AG")
        mine = set(before)
        ahead = [i for i, a in enumerate(after) if a not in mine]
        assert ahead == list(range(lead, lead + len(ahead)))  # one block, after the gathers
        assert [a for a in after if a in mine] == before
    assert first.lookahead_times.step_s == pytest.approx(simulate(first, workload).step_time_s)


def test_a_merge_with_fewer_pool_micro_batches_keeps_the_rest_in_order():
    """Only the scored rows go forward: the merge keeps its first k pool micro-batches."""
    step, workload, pool = schedules("optimus")
    merged = with_lookahead(step, pool, workload)
    fewer = with_fewer_ahead(merged, 3)  # validated inside
    assert fewer.meta.lookahead == 3 and fewer.meta.num_microbatches == N
    acts = [a for rank in fewer.ranks for a in rank]
    assert {a.mb for a in acts if a.kind in ("F", "EF") and a.mb >= N} == set(range(N, N + 3))
    for before, after in zip(merged.ranks, fewer.ranks, strict=True):
        kept = set(after)
        assert [a for a in before if a in kept] == after  # the merge's order
    assert with_fewer_ahead(merged, 0).meta.lookahead == 0
    with pytest.raises(ConfigError, match="the merge holds 8"):
        with_fewer_ahead(merged, POOL + 1)


def _subsequence(acts, keep) -> list:
    return [a for a in acts if keep(a)]


def test_the_searched_merge_keeps_both_orders_and_is_no_slower_than_its_seed():
    """--coreset-lookahead-order searched: each rank's pool groups moved between the step's
    groups; the step's order and the pool's order stay, the merge is valid, never slower in
    simulation than the shift merge it starts from, and the same on every call (every rank
    searches alone)."""
    step, workload, pool = schedules("optimus")
    merged = with_lookahead(step, pool, workload)
    searched = searched_merge(merged, workload, evals=300)
    validate(searched)
    assert searched.meta == merged.meta
    for before, after in zip(merged.ranks, searched.ranks, strict=True):
        assert sorted(map(str, before)) == sorted(map(str, after))  # the same actions
        for pooled in (True, False):

            def keep(a, pooled=pooled):
                return is_pool_action(a, N) == pooled

            assert _subsequence(after, keep) == _subsequence(before, keep)
    seed_s = simulate(merged, workload).step_time_s
    assert simulate(searched, workload).step_time_s <= seed_s
    assert searched.ranks == searched_merge(merged, workload, evals=300).ranks
    assert searched.ranks != merged.ranks  # on this pipeline the search finds a better place


def _busiest_rank_compute(schedule: Schedule, workload) -> float:
    times = simulate(schedule, workload).action_times
    idle_kinds = ("SEND", "RECV", "AG", "RS")
    return max(
        sum(
            times[(r, i)][1] - times[(r, i)][0]
            for i, a in enumerate(acts)
            if a.kind not in idle_kinds
        )
        for r, acts in enumerate(schedule.ranks)
    )


def test_the_search_reaches_bubbles_far_from_its_seed(monkeypatch):
    """The benchmark's shape (8 micro-batches, 11 of a 16-row pool going forward, GPT 4x256):
    the step's last bubbles lie many step groups from where the seed puts the pool, past points
    that cost; moves of a few groups never get there, a jump of one group between its
    neighbours does (the search lands near the busiest rank's compute)."""
    import megatron_mllm.schedule.merge_search as merge_search

    cfg = replace(TINY, llm_layers=4, llm_hidden=256, llm_heads=8, vit_hidden=128, text_len=64)
    step, workload = runtime_plan(cfg, PLAN, 2, 8, "optimus")
    pool = pool_plan(step, cfg, PLAN, 2, 16)[0]
    merged = with_fewer_ahead(with_lookahead(step, pool, workload), 11)
    bound = _busiest_rank_compute(merged, workload)

    def searched_s() -> float:
        return simulate(searched_merge(merged, workload, evals=1000), workload).step_time_s

    assert searched_s() < 1.05 * bound
    monkeypatch.setattr(merge_search, "JUMP_SHARE", 0.0)
    assert searched_s() > 1.06 * bound


def test_searched_counts_are_what_a_merge_with_fewer_pool_micro_batches_runs():
    step, workload, pool = schedules("optimus")
    merged = with_lookahead(step, pool, workload)
    searched = with_searched_counts(merged, workload, range(3, 6, 2), evals=200)
    assert sorted(searched.fewer_ahead) == [3, 5]
    whole = searched_merge(merged, workload, evals=200)  # the search for the whole pool alone
    assert searched.ranks == whole.ranks
    for k in (3, 5):
        fewer, trimmed = with_fewer_ahead(searched, k), with_fewer_ahead(merged, k)
        assert fewer is searched.fewer_ahead[k] and fewer.meta == trimmed.meta
        assert fewer.lookahead_times == searched.lookahead_times  # the whole pool's
        validate(fewer)
        # No slower than either trim it could start from: the shift merge's or the search's.
        seconds = simulate(fewer, workload).step_time_s
        assert seconds <= simulate(trimmed, workload).step_time_s
        assert seconds <= simulate(with_fewer_ahead(whole, k), workload).step_time_s
    trimmed = with_fewer_ahead(searched, 2)  # not searched: the whole pool's merge, trimmed
    assert trimmed.meta.lookahead == 2 and not trimmed.fewer_ahead


def test_look_ahead_micro_batches_are_forward_only_in_the_validator_and_hold_no_memory():
    step, workload, pool = schedules("megatron", n=2, pool=2)
    merged = with_lookahead(step, pool, workload)
    broken = Schedule(merged.meta, [list(r) for r in merged.ranks])
    broken.ranks[1].append(B(1, N - 2))  # micro-batch 2 is the pool's (the step has 2)
    with pytest.raises(ScheduleError, match=r"\[lookahead\] micro-batch 2 is a look-ahead one"):
        validate(broken)
    missing = Schedule(merged.meta, [[a for a in r if a != F(1, 3)] for r in merged.ranks])
    with pytest.raises(ScheduleError, match=r"\[missing\] no F:s1v0m3"):
        validate(missing)
    # A look-ahead forward keeps no activation for a backward: the peak is the step's own.
    alone = simulate(step, workload).activation_peaks
    assert simulate(merged, workload).activation_peaks == pytest.approx(alone)


def _job(state, step, workload, pool, lookahead: bool, order: str = "simulated") -> RuntimeJob:
    merged = lookahead_merge(step, pool, workload, order, range(1, POOL)) if lookahead else None
    return RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(PLAN, schedule=step),
        DataParts(
            1,
            N,
            coreset=CoresetConfig(batch_size=N, pool_ratio=2, features="zo", seed=3),
            pool_schedule=pool,
            lookahead_schedule=merged,
        ),
        optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.5),
        collect=Collect(grads=False),
        executor=ExecutorSettings(ordered_p2p=True),  # NCCL's matching by order
    )


def _against_a_saved_copy(rank: int, world: int, jobs) -> dict:
    """Three runs on the same ranks: `ahead` looks ahead; `plain` selects each step's own pool
    (the same training at step 0); `copy` never steps: before each step it takes a copy of
    `ahead`'s weights and selector, and selects the next pool with them. `plain` and `copy`
    post their own broadcasts while `ahead`'s rows are still pending."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    device = init_rank(rank, world, 0, 60)
    ahead, plain, saved = (ExecutorRun(rank, world, job, device) for job in jobs)
    rows, expected, updated, reads = [], [], [], []
    read = ahead.coreset.pool_list
    ahead.coreset.pool_list = lambda pool: reads.append(step) or read(pool)
    for step in range(3):
        _copy_weights(saved, ahead)
        saved.coreset.selector.load_state_dict(copy.deepcopy(ahead.coreset.selector.state_dict()))
        selector = copy.deepcopy(ahead.coreset.selector.state_dict())
        ahead.step(step)
        plain.step(step)
        if rank == 0:  # stage 0 has no rows until the next step first needs a micro-batch
            assert ahead.coreset.pending == (step + 1, None)
        ahead.coreset.data(step + 1)(0, 0)  # takes them there, from the rows' own group
        rows.append(ahead.coreset.pending[1])
        if step == 0:
            continue  # at step 0 the selector also chose step 0's own pool first
        pool = saved.coreset.pool_list(saved.data.pool(step + 1))
        expected.append(saved.coreset.pool_rows(pool))
        # The same with the weights after the update: the selection depends on which.
        _copy_weights(saved, ahead)
        saved.coreset.selector.load_state_dict(selector)
        updated.append(saved.coreset.pool_rows(pool))
    return {"rows": rows[1:], "expected": expected, "updated": updated,
            "ahead": ahead.history, "plain": plain.history,
            "fewer": sorted(ahead.coreset._aheads), "reads": reads}  # fmt: skip


def _copy_weights(to, source) -> None:
    for mine, theirs in zip(to.rank_model.modules, source.rank_model.modules, strict=True):
        mine.load_state_dict(copy.deepcopy(theirs.state_dict()))


@pytest.mark.parametrize("order", ["simulated", pytest.param("searched", marks=pytest.mark.slow)])
def test_look_ahead_selects_with_the_steps_own_weights_and_trains_the_same(order):
    """PP=2 Optimus, ordered messages: the rows chosen during step t for step t+1 are those a
    saved copy of step t's weights and selector chooses; step 0 (the same selection in both)
    trains to the same losses with or without the next pool merged into it (in either order:
    the searched one runs a merge of its own for each count of scored micro-batches). A pool is
    read once: step t reads step t+1's for its forward, and step t+1 picks its rows from it."""
    state = spawn(make_full_state, 1, TINY, 0)[0]
    step, workload, pool = schedules("optimus")
    jobs = [_job(state, step, workload, pool, la, order) for la in (True, False, False)]
    for job in jobs:
        check_job(job, 2)
    outs = spawn(_against_a_saved_copy, 2, jobs)
    for out in outs:  # every rank of the pipeline holds the rows
        assert out["rows"] == out["expected"] == outs[1]["rows"]
        assert len(set(out["rows"][0])) == N
        assert out["updated"] != out["expected"]  # the test can tell the weights apart
        assert out["fewer"] and all(k < POOL for k in out["fewer"])  # only scored rows went
        assert out["reads"] == [0, 0, 1, 2]  # step 0 also selects its own pool first
    last = outs[1]  # the losses live on the last stage
    assert last["ahead"][0] == last["plain"][0]


def _replanned_after_step_0(rank: int, world: int, jobs) -> dict:
    """Each job twice on these ranks, one re-planned (--replan-after-iters 1) after step 0 on
    the unit times it measured, its backbone's backward read 4x slower (so that the plans
    change), with the look-ahead's rows still in flight."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    device = init_rank(rank, world, 0, 60)
    out = {}
    for name, job in jobs.items():
        kept, replanned = (ExecutorRun(rank, world, job, device) for _ in range(2))
        measured = replanned.gathered_unit_times

        def slower(measured=measured) -> list[dict]:
            return [{k: [4 * t for t in v] if k[:2] == ("llm", "backward") else v
                     for k, v in ranks.items()} for ranks in measured()]  # fmt: skip

        replanned.gathered_unit_times = slower
        before, rows = replanned.job.data, {"kept": [], "replanned": []}
        for step in range(3):
            for label, run in (("kept", kept), ("replanned", replanned)):
                run.step(step)
                if label == "replanned" and step == 0:
                    assert run.replan()
                if run.coreset.lookahead:  # every stage takes the rows
                    run.coreset.data(step + 1)(0, 0)
                    rows[label].append(run.coreset.pending[1])
        after = replanned.job.data
        ahead = after.lookahead_schedule
        out[name] = {
            "rows": rows,
            "losses": (kept.history, replanned.history),
            "pool": after.pool_schedule.ranks != before.pool_schedule.ranks,
            "merge": ahead is not None and ahead.ranks != before.lookahead_schedule.ranks,
            "programs": ahead is None
            or replanned.coreset.ahead_program == gpu_program(ahead, replanned.groups, 1),
            "order": after.lookahead_order,
        }
    return out


def test_a_replan_plans_the_pool_pass_and_the_look_ahead_merge_again_and_trains_the_same():
    """--replan-after-iters with a coreset: after step 0 the step and its pool pass and, under
    look-ahead, the merge (in the job's order) are planned again on the unit times the job
    measured, the programs rebuilt, the look-ahead's rows' broadcast settled first; the rows
    chosen and the losses are those of the run that kept its start-up plans (a plan orders
    work, it computes nothing else)."""
    state = spawn(make_full_state, 1, TINY, 0)[0]
    step, workload, pool = schedules("optimus")
    jobs = {}
    for name, lookahead in (("ahead", True), ("same_step", False)):
        job = _job(state, step, workload, pool, lookahead, "searched")
        data = replace(job.data, lookahead_order="searched")
        jobs[name] = replace(job, data=data, executor=replace(job.executor, replan_after=1))
        check_job(jobs[name], 2)
    outs = spawn(_replanned_after_step_0, 2, jobs)
    for name in jobs:
        for out in (o[name] for o in outs):
            assert out["rows"]["kept"] == out["rows"]["replanned"] == outs[1][name]["rows"]["kept"]
            assert out["pool"] and out["programs"] and out["order"] == "searched"
        kept, replanned = outs[1][name]["losses"]  # the losses live on the last stage
        assert replanned == kept
    assert all(o["ahead"]["merge"] for o in outs)


def test_a_look_ahead_job_is_checked_before_anything_starts():
    state = {}
    step, workload, pool = schedules("optimus")
    job = _job(state, step, workload, pool, True)
    with pytest.raises(ConfigError, match="drop optimus-adaptive"):
        check_job(
            RuntimeJob(job.model, job.plans, job.data, executor=ExecutorSettings(adaptive=True)),
            2,
        )
    small_step, small_workload, small_pool = schedules("optimus", pool=4)
    other = with_lookahead(small_step, small_pool, small_workload)
    with pytest.raises(ConfigError, match=r"has 4 \+ 4 micro-batches; the job needs 4 \+ 8"):
        check_job(RuntimeJob(job.model, job.plans, _data(job, other)), 2)


def _data(job, lookahead):
    from dataclasses import replace

    return replace(job.data, lookahead_schedule=lookahead)


def test_lookahead_arguments_are_checked_in_one_line(monkeypatch, capsys):
    """Without a coreset: refused; with re-planning: accepted; on one pipeline stage: a
    warning line."""
    from megatron_mllm.training.arguments import parse_args
    from tests.pretrain_runs import refused

    refused(["--coreset-lookahead"], "--coreset-lookahead needs --coreset-pool-ratio", monkeypatch)
    pp2 = ["--pipeline-model-parallel-size", "2", "--coreset-pool-ratio", "2"]
    replanned = parse_args([*pp2, "--coreset-lookahead", "--replan-after-iters", "1"])
    assert replanned.replan_after_iters == 1  # the merge is made again on a re-plan
    capsys.readouterr()
    parse_args(["--coreset-pool-ratio", "2", "--coreset-lookahead"])
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1, warning
    assert warning[0].startswith("WARNING: --coreset-lookahead at --pipeline-model-parallel-size 1")
    assert "no pipeline bubbles" in warning[0]
    assert parse_args([*pp2, "--coreset-lookahead"]).coreset_lookahead_order == "simulated"
    assert capsys.readouterr().err == ""
    order = ["--coreset-lookahead-order", "pool-first"]
    assert parse_args([*pp2, "--coreset-lookahead", *order]).coreset_lookahead_order == order[1]
    refused([*pp2, *order], "--coreset-lookahead-order pool-first orders the look-ahead's pool; "
            "add --coreset-lookahead", monkeypatch)  # fmt: skip


@pytest.mark.slow  # two torchrun jobs; selection and training are checked above in make test
def test_a_look_ahead_run_resumes_exactly(tmp_path):
    """PP=2 with --coreset-lookahead, saved at 2: the checkpoint holds the rows chosen for
    iteration 3 during iteration 2 (and the position before their pool); resumed, iterations
    3 and 4 train exactly as in the uninterrupted run, and iteration 4's tensors are equal."""
    from tests.pretrain_runs import COMMON, resumed_at_2_is_bit_exact

    args = [*COMMON, "--pipeline-model-parallel-size", "2", "--train-iters", "4",
            "--coreset-pool-ratio", "2", "--coreset-lookahead"]  # fmt: skip
    straight, resumed, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    assert "coreset look-ahead: the next pool's forward in this step's bubbles (simulated)" in (
        straight.stdout
    )


def _scored_and_whole(rank: int, world: int, job: RuntimeJob) -> list:
    """Per step: the rows chosen after forwarding only the scored rows, the rows chosen after
    forwarding the whole pool (the same selector state), and the pool's sources; then the
    counts of the fewer-micro-batch passes made."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    run = ExecutorRun(rank, world, job, init_rank(rank, world, 0, 60))
    coreset, out = run.coreset, []
    for step in range(4):
        batches = coreset.pool_list(run.data.pool(step))
        state = copy.deepcopy(coreset.selector.state_dict())
        scored = coreset.pool_rows(batches)
        coreset.selector.load_state_dict(state)  # the same directions and moments again
        coreset.score_only = False  # every pool row goes forward
        whole = coreset.pool_rows(batches)
        coreset.score_only = True
        out.append((scored, whole, [s for b in batches for s in b.sources]))
    return [*out, sorted(coreset._passes)]


def test_only_scored_rows_go_forward_and_the_choice_is_the_whole_pools():
    """PP=2 Optimus, ordered messages: on imbalanced pools (the synthetic classes), the pass
    forwards the scored rows' micro-batches only, and every stage gets the rows a pass over
    the whole pool would choose."""
    state = spawn(make_full_state, 1, TINY, 0)[0]
    step, workload, pool = schedules("optimus")
    job = _job(state, step, workload, pool, False)
    ranks = spawn(_scored_and_whole, 2, job)
    *steps, passes = ranks[0]
    assert ranks[1][-1] == passes and passes and all(0 < n < POOL for n in passes)
    for r, results in enumerate(ranks):
        for scored, whole, _ in results[:-1]:
            assert scored == whole and len(scored) == N, (r, scored, whole)
    # the rows that did not go forward (their sources kept whole) are all chosen
    selector = CoresetSelector(job.data.coreset)
    skipped = 0
    for scored, _, sources in steps:
        forwarded = set(selector.scored_rows(torch.tensor(sources)).tolist())
        whole = {i for i in range(len(sources)) if i not in forwarded}
        assert whole <= set(scored)
        skipped += len(whole)
    assert skipped > 0
