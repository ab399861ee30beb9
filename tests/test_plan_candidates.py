"""--plan-candidates (training/plan_candidates.py, candidate_run.py): the planner's K best plans
and the Megatron schedule each train real steps, and the fastest measured is kept; the steps
train as one run."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from functools import partial

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    Collect,
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.modes.runs import run_interleaved, run_rank
from megatron_mllm.runtime.planning.schedules import job_of
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.training.candidate_run import CandidateRun
from megatron_mllm.training.plan_candidates import (
    CLOSE_CALL_Z,
    LAYOUT_WARMUP,
    STEPS_EACH,
    Candidate,
    CandidatePhase,
    check_counts,
    check_phase,
    close_call,
    fastest,
    layout_key,
    most_steps,
    plan_candidates,
    windows,
)

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
N = 4
PLAN = ParallelPlan(1, 1, 2)
OPT = OptimizerSettings(lr=1e-2, clip_grad=0.5)


def test_plan_candidates_are_the_k_best_and_the_megatron_schedule():
    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    for k in (1, 2, 3):
        cands = plan_candidates(costs, k)
        labels = [c.label for c in cands]
        assert "megatron" in labels and len(set(labels)) == len(labels)
        assert len(cands) in (k, k + 1)
        optimus = [c.predicted_s for c in cands if c.label != "megatron"]
        assert optimus == sorted(optimus)
    assert plan_candidates(costs, 2)[0].label == plan_candidates(costs, 1)[0].label
    three = plan_candidates(costs, 3)
    layouts = [layout_key(c.schedule, PLAN, c.units) for c in three]
    assert len(set(layouts)) == len(layouts)  # one candidate per module layout
    assert [c.layout for c in three] == list(range(len(three)))


def test_each_module_layout_warms_up_on_its_first_candidate():
    """Candidates on layouts 0, 0, 1, 2: the first plan's `warmup` steps, then LAYOUT_WARMUP on
    candidates 2 and 3; each layout's read steps are its last ones but the first after a switch;
    0 turns it off (every candidate predicted from the first plan's warm-up)."""
    cands = tuple(Candidate(str(i), None, layout=j) for i, j in enumerate((0, 0, 1, 2)))
    phase = CandidatePhase(cands, steps_each=3, warmup=4)
    assert phase.warmup_windows == [(0, 4), (2, LAYOUT_WARMUP), (3, LAYOUT_WARMUP)]
    assert phase.warmup_steps == 4 + 2 * LAYOUT_WARMUP == 10
    assert phase.read_steps() == {0: range(2, 4), 1: range(5, 7), 2: range(8, 10)}
    assert [phase.warmup_candidate(s) for s in range(10)] == [0] * 4 + [2] * 3 + [3] * 3
    off = replace(phase, layout_warmup=0)
    assert off.warmup_windows == [(0, 4)] and off.steps == phase.steps - 2 * LAYOUT_WARMUP
    assert most_steps(1, 1, 5, LAYOUT_WARMUP) == most_steps(1, 1, 5, 0) + LAYOUT_WARMUP
    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    real = CandidatePhase(tuple(plan_candidates(costs, 2, "layer", True, True)))
    assert real.steps <= most_steps(2, 2, STEPS_EACH, LAYOUT_WARMUP)  # the refusal's bound
    with pytest.raises(ConfigError, match="layout-warmup 1: give 0"):
        check_counts(1, 5, 1)


def test_the_split_backward_is_one_more_candidate_and_stays_split_when_replanned():
    """--encoder-wgrad-split with --plan-candidates: the best Optimus layout's schedule with
    the encoder's backward split (EW actions) is one more candidate on the same modules, in
    the order of its prediction; re-planned from measured times it stays split, its costs
    rebuild with the split, and a checkpoint that kept it gives it back."""
    from megatron_mllm.runtime.planning.replan import measured_workload, replan_job
    from megatron_mllm.training.plan_candidates import kept_plan

    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    plain, cands = plan_candidates(costs, 2), plan_candidates(costs, 2, wgrad_split=True)
    split = [c for c in cands if c.schedule.meta.splits_weight_grads]
    assert len(cands) == len(plain) + 1 and len(split) == 1 and split[0].label.endswith(" split")
    base = next(c for c in plain if c.label != "megatron")
    assert split[0].label == base.label + " split"
    assert layout_key(split[0].schedule, PLAN, "layer") == layout_key(base.schedule, PLAN, "layer")
    assert split[0].layout == next(c.layout for c in cands if c.label == base.label)
    optimus = [c.predicted_s for c in cands if c.label != "megatron"]
    assert optimus == sorted(optimus) and cands[-1].label == "megatron"
    assert not any(c.schedule.meta.splits_weight_grads for c in plain)
    job = _job({}, split[0].schedule)
    samples = [{("vision", "backward", "layer_b"): [0.02]}, {("llm", "forward", "layer"): [0.01]}]
    again = replan_job(job, samples)
    assert again is not None and again[0].meta.splits_weight_grads
    assert any(a.kind == "EW" for acts in again[0].ranks for a in acts)
    assert measured_workload(job, samples).encoder_wgt[0][0]  # rebuilt with the split
    record = {"schedule": split[0].schedule.to_csv(), "units": "layer"}
    schedule, workload = kept_plan({"plan_candidates": record}, costs)
    assert schedule.ranks == split[0].schedule.ranks and workload.encoder_wgt[0][0]


def test_a_replan_keeps_the_current_plan_where_its_split_would_not_fit(monkeypatch):
    """Re-planned from measured times, a split schedule stays split only where the split plan
    fits in memory (it holds output gradients the new options were not chosen with); else
    the re-plan keeps the current plan (None)."""
    from megatron_mllm.runtime.planning import replan as replanning

    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    cands = plan_candidates(costs, 2, wgrad_split=True)
    job = _job({}, next(c for c in cands if c.schedule.meta.splits_weight_grads).schedule)
    samples = [{("vision", "backward", "layer_b"): [0.02]}, {("llm", "forward", "layer"): [0.01]}]
    assert replanning.replan_job(job, samples) is not None
    real = replanning.simulate

    def over_memory(schedule, workload, **kw):
        return replace(real(schedule, workload, **kw), peak_memory_bytes=1e15)

    monkeypatch.setattr(replanning, "simulate", over_memory)
    assert replanning.replan_job(job, samples) is None


def test_the_backbone_split_is_one_more_candidate_and_stays_split_when_replanned():
    """--backbone-wgrad-split with --plan-candidates: the best Optimus layout's schedule with
    the backbone's backward split (W actions) is one more candidate on the same modules;
    re-planned from measured times it stays split, and a checkpoint that kept it gives it
    back."""
    from megatron_mllm.runtime.planning.replan import replan_job
    from megatron_mllm.training.plan_candidates import kept_plan

    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    plain, cands = plan_candidates(costs, 2), plan_candidates(costs, 2, backbone_split=True)
    split = [c for c in cands if c.schedule.meta.backbone_wgrad]
    assert len(cands) == len(plain) + 1 and len(split) == 1
    base = next(c for c in plain if c.label != "megatron")
    assert split[0].label == base.label + " bb-split"
    assert layout_key(split[0].schedule, PLAN, "layer") == layout_key(base.schedule, PLAN, "layer")
    assert split[0].layout == next(c.layout for c in cands if c.label == base.label)
    job = _job({}, split[0].schedule)
    samples = [{("vision", "backward", "layer_b"): [0.02]}, {("llm", "forward", "layer"): [0.01]}]
    again = replan_job(job, samples)
    assert (
        again is not None and again[0].meta.backbone_wgrad == split[0].schedule.meta.backbone_wgrad
    )
    assert any(a.kind == "W" for acts in again[0].ranks for a in acts)
    record = {"schedule": split[0].schedule.to_csv(), "units": "layer"}
    schedule, _ = kept_plan({"plan_candidates": record}, costs)
    assert schedule.ranks == split[0].schedule.ranks


def test_kernel_fill_candidates_keep_the_megatron_schedule_in_layers():
    """With --fill-granularity kernel the Optimus candidates plan kernel units, while the
    Megatron candidate's encoder runs whole layers on stage 0: its schedule is the one layer
    costs give, which the in-job re-plan rebuilds (it failed in one line before)."""
    from megatron_mllm.runtime.planning.schedules import plan_job

    job = job_of(TINY, PLAN, 1, N)
    cands = plan_candidates(JobCosts(job, unit="kernel"), 2, "kernel")
    megatron = next(c for c in cands if c.label == "megatron")
    assert megatron.units == "layer"
    assert {c.units for c in cands if c.label != "megatron"} == {"kernel"}
    plan_job(job, "balanced", unit="layer")[1].check_matches(megatron.schedule.meta)


def test_the_fastest_recorded_candidate_is_kept(tmp_path):
    """From a recorded file of per-step seconds: candidate 2 ran first after warm-up, in windows
    mirrored around the phase's middle, and its timed steps (not its windows' warm-up steps) are
    the fastest; ties go to the earlier candidate."""
    phase = CandidatePhase(candidates=(None, None, None), steps_each=3, warmup=2)
    record = tmp_path / "steps.json"
    # warm-up | 2: 9.0 (warm-up), 1.0 | 0: 1.1, 1.3 | 1: 0.5, 2, 2 | 0: 1.2, 1.4 | 2: 3.0, 1.2
    steps = [5.0, 5.0, 9.0, 1.0, 1.1, 1.3, 0.5, 2.0, 2.0, 1.2, 1.4, 3.0, 1.2]
    record.write_text(json.dumps(steps))
    ran = windows([2, 0, 1], 3)
    assert phase.end(ran) == len(steps) == phase.steps - phase.second_look_steps
    best, timed = fastest(json.loads(record.read_text()), ran, phase.warmup)
    assert best == 2 and timed == {2: [1.0, 1.2], 0: [1.3, 1.4], 1: [2.0, 2.0]}
    tie = [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert fastest(tie, ran, phase.warmup)[0] == 0


def test_a_close_call_gets_a_second_look_and_a_clear_win_none():
    """The two fastest medians within two standard errors of their difference (the noise read
    from every candidate's spread about its own median) are a close call; far apart, or with
    one timed step each (no spread), they are not. The second look's windows count in the
    phase's longest length, what they time joins the first round's in the decision, and the
    kept plan is one of the pair."""
    noisy = {0: [1.00, 1.10, 0.90, 1.05], 1: [1.02, 0.95, 1.12, 1.00], 2: [1.5, 1.6, 1.4, 1.5]}
    assert close_call(noisy) == (1, 0)  # 1's median is lower
    clear = {0: [1.00, 1.01, 0.99, 1.00], 1: [1.10, 1.11, 1.09, 1.10], 2: [1.5] * 4}
    assert close_call(clear) is None
    assert close_call({0: [1.0], 1: [1.0]}) is None and close_call({0: [1.0, 2.0]}) is None
    phase = CandidatePhase(candidates=(None, None, None), steps_each=5, warmup=4)
    assert phase.second_look_steps == 3 + 5 + 3
    assert phase.steps == 4 + (3 + 3 + 5 + 3 + 3) + 11
    assert CandidatePhase((None, None), steps_each=2).second_look_steps == 0
    # 2 warm-up | 0: w, 1.0 | 1: w, 0.9, 1.1 | 0: w, 1.2 | then the second look at 1 and 0
    first = windows([0, 1], 3)
    ran = first + windows([1, 0], 3)
    seconds = [5, 5, 9, 1.0, 9, 0.9, 1.1, 9, 1.2] + [9, 1.3, 9, 1.0, 0.9, 9, 1.4]
    best, timed = fastest(seconds, ran, 2)
    assert timed == {0: [1.0, 1.2, 1.0, 0.9], 1: [0.9, 1.1, 1.3, 1.4]} and best == 0
    assert fastest(seconds, first, 2)[0] == 1  # the first round alone kept the other
    faster = [0.1 if s in (10, 15) else t for s, t in enumerate(seconds)]  # 1's second look
    assert fastest(faster, ran, 2)[0] == 1 and fastest(faster, ran, 2, among=[0])[0] == 0
    assert close_call({0: [1.0, 1.0], 1: [2.0, 2.0]}, z=math.inf) == (0, 1)  # no spread


def _job(state, schedule=None, **kw):
    return RuntimeJob(
        ModelParts(TINY, state), PlanParts(PLAN, schedule), DataParts(1, N), optimizer=OPT, **kw
    )


def test_refusals_in_one_line():
    job = _job({})
    with pytest.raises(ConfigError, match="at least 1"):
        check_phase(0, 3, job)
    with pytest.raises(ConfigError, match="at least 2 steps"):
        check_phase(2, 1, job)
    adaptive = _job({}, executor=ExecutorSettings(adaptive=True))
    with pytest.raises(ConfigError, match="optimus-adaptive"):
        check_phase(2, 3, adaptive)
    with pytest.raises(ConfigError, match="megatron-core"):
        check_phase(2, 3, _job({}, mode="megatron_core"))


@pytest.mark.slow  # 25 s each; test_training resumes the candidates phase in make test
@pytest.mark.parametrize("split", ["wgrad_split", "backbone_split"])
def test_candidate_steps_train_as_one_run(split):
    """Three candidates on two module layouts (Optimus with its encoder replicated on both
    ranks, plain and with its encoder's or backbone's backward split, and the Megatron schedule
    with the encoder on stage 0): every step's losses, in and after the phase, equal the
    one-process reference's; the switches carried the state across layouts and back (the first
    candidate's mirrored window runs on modules that trained before). A split backbone
    backward adds its micro-batch's weight gradient into the fp32 sum last, so its steps
    differ from the reference's in the last bits (test_backbone_weight_split shows it exact
    in the reference's order), which Adam at this learning rate amplifies from the sixth step
    on: there only the steps before that are compared."""
    costs = JobCosts(job_of(TINY, PLAN, 1, N), unit="layer")
    cands = tuple(plan_candidates(costs, 1, **{split: True}))
    assert [c.label for c in cands][-1] == "megatron" and len(cands) == 3
    # calibrated on step 1; with the encoder's split every call is close: a second look
    z = math.inf if split == "wgrad_split" else CLOSE_CALL_Z
    phase = CandidatePhase(cands, steps_each=3, warmup=2, close_call_z=z)
    steps = phase.steps + 1
    state = spawn(make_full_state, 1, TINY, 0)[0]
    ref_job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(ParallelPlan(1, 1, 1)),
        DataParts(1, N),
        mode="reference",
        steps=steps,
        optimizer=OPT,
        collect=Collect(grads=False),
    )
    ref = spawn(run_rank, 1, ref_job)[0]
    job = _job(state, cands[0].schedule, steps=steps, collect=Collect(grads=False))
    outs = spawn(run_interleaved, 2, [job], steps, [partial(CandidateRun, phase=phase)])
    outs = [o[0] for o in outs]
    assert len(outs[0]["history"]) == steps
    compared = ref["history"] if split == "wgrad_split" else ref["history"][:5]
    for step, losses in enumerate(compared):
        mine = {k: v for o in outs for k, v in o["history"][step].items()}
        assert mine.keys() == losses.keys()
        assert all(mine[k] == pytest.approx(v, abs=1e-5) for k, v in losses.items()), step
    ran = outs[0]["candidate_of_step"]
    a, b, c = outs[0]["candidate_order"]
    # warm-up: 2 steps on the first plan, 3 on the Megatron schedule's layout (candidate 2)
    assert ran[:16] == [0, 0, 2, 2, 2] + [a] * 2 + [b] * 2 + [c] * 3 + [b] * 2 + [a] * 2
    rows = outs[0]["candidates"]
    kept = [r for r in rows if r["kept"]]
    assert len(kept) == 1 and ran[-1] == rows.index(kept[0])
    looked = outs[0]["candidate_second_look"] or []  # a close call: two more timed each
    assert looked or split != "wgrad_split"
    if looked:  # its windows after the first round's, the one running first
        assert ran[16:23] == [looked[0]] * 2 + [looked[1]] * 3 + [looked[0]] * 2
        assert len(looked) == 2 and (looked[0] == a or a not in looked)  # no switch first
    assert [len(r["timed"]) for r in rows] == [4 if i in looked else 2 for i in range(3)]
    assert all(r["predicted_s"] > 0 for r in rows), rows  # all ran
    among = [r for i, r in enumerate(rows) if i in looked or not looked]  # a second look's pair
    assert kept[0]["measured_s"] == min(r["measured_s"] for r in among)
    assert outs[0]["candidate_layouts"] == 2
    calibration = outs[0]["candidate_calibration"]  # measured between the stages, not fitted
    assert len(calibration["by_layout"]) == 2  # each layout's own warm-up read
    assert 0 < calibration["message_s"] < 1 and calibration["latency_s"] >= 0
    assert abs(calibration["unexplained_s"]) < 1
    assert set(calibration["dp_gbps"]) == {"reduce_scatter", "all_gather"}  # timed in the job
