import json

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.parallel.plans import ParallelPlan, colocated_encoder_plan
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.cost_model import CostModel, load_measured_times
from megatron_mllm.schedule.hardware import get_profile
from megatron_mllm.schedule.planner import plan_all, plan_optimus, run
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.specs import BUILTIN_MODELS
from megatron_mllm.schedule.trace import chrome_trace_events
from tests.conftest import tiny_encoder, tiny_job


def paper_job(gpus=3072, **kw):
    return MLLMJob(
        (BUILTIN_MODELS["vit-22b"],),
        BUILTIN_MODELS["gpt-175b"],
        gpus,
        8,
        8,
        1536,
        2,
        2048,
        get_profile("h100"),
        **kw,
    )


def test_memory_filter_drops_plans_that_cannot_fit():
    costs = JobCosts(paper_job())
    best, candidates, dropped = plan_optimus(costs)
    dropped_plans = {p for p, _ in dropped}
    assert ParallelPlan(3072, 1, 1) in dropped_plans  # a whole ViT-22B per GPU: ~150 GB
    assert all(need >= 80 for _, need in dropped)
    assert best.result.peak_memory_gb <= 80
    with pytest.raises(ConfigError, match="fits in 80 GB"):
        plan_optimus(costs, encoder_plan=ParallelPlan(3072, 1, 1))


def test_optimus_beats_both_baselines_on_the_paper_job():
    report = plan_all(JobCosts(paper_job()))
    opt = report.optimus.result.step_time_s
    assert opt < report.megatron.result.step_time_s
    assert opt < report.balanced.result.step_time_s
    assert report.optimus.result.limit_s <= opt


def test_dependency_points_hold_in_simulation():
    job = tiny_job(gpus=8, tp=2, pp=2, microbatches=6)
    schedule, workload = optimus_schedule(JobCosts(job), OptimusOptions(ParallelPlan(4, 1, 2)))
    res = simulate(schedule, workload)
    enc = schedule.meta.encoders[0]
    last = enc.num_stages - 1
    done_fwd, start_bwd = {}, {}
    for (r, i), (a, b) in res.action_times.items():
        act = schedule.ranks[r][i]
        if act.kind == "EF" and act.stage == last and act.k1 == enc.fwd_kernels[last]:
            done_fwd[act.mb] = b
        if act.kind == "EB" and act.stage == last and act.k0 == 0:
            start_bwd[act.mb] = a
    for m in range(job.num_microbatches):
        assert done_fwd[m] <= res.mb_forward_start[m] + 1e-12  # F_i
        assert start_bwd[m] >= res.mb_backward_end[m] - 1e-12  # B_i


def test_fine_schedule_uses_tp_bubbles_and_is_kept_only_when_faster():
    """A fill's outputs leave with the backbone action it filled (its SEND comes after it in
    the list), so fills pay where the encoder is not pipelined (encoder PP 1 here: its output
    stays on the rank); with encoder stages on other ranks they mostly do not."""
    costs = JobCosts(
        MLLMJob(
            (BUILTIN_MODELS["vit-5b"],),
            BUILTIN_MODELS["gpt-11b"],
            64,
            4,
            4,
            64,
            1,
            2048,
            get_profile("h100"),
        )
    )
    plan = ParallelPlan(16, 4, 1)
    fine = run("o", optimus_schedule(costs, OptimusOptions(plan, split="even")))
    coarse = run("o", optimus_schedule(costs, OptimusOptions(plan, split="even", fine=False)))
    fills = [a for acts in fine.schedule.ranks for a in acts if a.fill is not None]
    assert fills and not any(a.fill is not None for acts in coarse.schedule.ranks for a in acts)
    assert fine.result.step_time_s < coarse.result.step_time_s
    best, _, _ = plan_optimus(costs)
    assert best.result.step_time_s <= min(fine.result.step_time_s, coarse.result.step_time_s)


def test_frozen_encoder_runs_forward_only_but_trains_the_projector():
    job = tiny_job(gpus=4, tp=1, pp=2, frozen=True)
    schedule, workload = optimus_schedule(JobCosts(job), OptimusOptions(ParallelPlan(2, 1, 2)))
    enc = schedule.meta.encoders[0]
    assert enc.bwd_kernels[0] == 0 and enc.bwd_kernels[-1] == 2  # projector fc2, fc1
    ebs = [a for acts in schedule.ranks for a in acts if a.kind == "EB"]
    assert ebs and all(a.stage == enc.num_stages - 1 for a in ebs)
    run("o", (schedule, workload))


def test_several_encoders_share_the_bubbles():
    encoders = (tiny_encoder(4, 256, "vit-a"), tiny_encoder(2, 512, "vit-b"))
    job = tiny_job(gpus=8, tp=2, pp=2, encoders=encoders, microbatches=4)
    best, _, _ = plan_optimus(JobCosts(job))
    meta = best.schedule.meta
    assert [e.name for e in meta.encoders] == ["vit-a", "vit-b"]
    done = {(a.enc, a.mb) for acts in best.schedule.ranks for a in acts if a.kind == "EF"}
    assert done == {(e, m) for e in range(2) for m in range(4)}


def test_encoder_plan_rules():
    backbone = paper_job().plan
    assert colocated_encoder_plan(backbone, 2, 4) == ParallelPlan(384, 2, 4)
    with pytest.raises(ConfigError, match="does not divide backbone PP 8"):
        colocated_encoder_plan(backbone, 1, 3)


def test_encoder_stages_last_first_fill_the_later_stages_warm_up_and_cool_down():
    """PP_e = PP = 2: the encoder's stage 0 on the last backbone stage, which idles while the
    first fills the pipeline and drains it; its output is made where the backbone reads it."""
    from dataclasses import replace

    from megatron_mllm.runtime.job import encoder_plan_of

    costs = JobCosts(tiny_job(gpus=2, tp=1, pp=2, microbatches=8))
    forward = ParallelPlan(1, 1, 2)
    last_first = replace(forward, reversed_stages=True)
    steps = {}
    for plan in (forward, last_first):
        planned = run("optimus", optimus_schedule(costs, OptimusOptions(plan)))  # validated
        steps[plan] = planned.result.step_time_s
        assert encoder_plan_of(planned.schedule, costs.job.plan) == (plan, False)
        stages = [lane for lane, _ in planned.schedule.meta.encoders[0].placement[0]]
        assert stages == ([1, 0] if plan.reversed_stages else [0, 1])
    assert steps[last_first] < steps[forward]
    best, candidates, _ = plan_optimus(costs)
    assert {forward, last_first} <= {c[0].encoder_plan for c in candidates}
    assert best.options.encoder_plan == last_first
    assert str(last_first) == "DP1 TP1 PP2 reversed"


def test_a_schedule_with_encoder_stages_elsewhere_is_refused_in_one_line():
    from dataclasses import replace

    from megatron_mllm.runtime.job import encoder_plan_of

    costs = JobCosts(tiny_job(gpus=4, tp=1, pp=4, microbatches=8))
    schedule, _ = optimus_schedule(costs, OptimusOptions(ParallelPlan(2, 1, 2)))
    enc = schedule.meta.encoders[0]
    shuffled = replace(enc, placement=(((1, 0), (2, 0)), ((0, 0), (3, 0))))
    schedule.meta = replace(schedule.meta, encoders=(shuffled,))
    with pytest.raises(ConfigError, match=r"encoder stages sit on backbone stages \[1, 2\]"):
        encoder_plan_of(schedule, costs.job.plan)


def test_measured_times_replace_the_analytic_ones(tmp_path):
    job = tiny_job()
    path = tmp_path / "times.json"
    path.write_text(json.dumps({"tiny-vit": {"forward": {"fc1": 0.5}}}))
    measured = load_measured_times(str(path), ["tiny-vit", "tiny-gpt"])
    slow = JobCosts(job, measured).encoder_layer(0, 1)
    assert [k.compute_s for k in slow.fwd if k.name == "fc1"] == [0.5]
    fast = JobCosts(job).encoder_layer(0, 1)
    assert next(k.compute_s for k in fast.fwd if k.name == "fc1") < 0.5
    path.write_text(json.dumps({"dp": {"gbps": {"reduce_scatter": 0.3, "all_gather": 0.6}}}))
    assert load_measured_times(str(path), ["tiny-vit"])["dp"]["gbps"]["all_gather"] == 0.6
    for bad, msg in (
        ({"other": {}}, "not in this run"),
        ({"tiny-vit": {"forward": {"fc9": 1.0}}}, "unknown forward kernel"),
        ({"tiny-vit": {"sideways": {}}}, "use forward, backward or collectives"),
        ({"tiny-gpt": {"collectives": {"broadcast": 1.0}}}, "unknown collectives kernel"),
        ({"dp": {"gbps": {"all_reduce": 1.0}}}, '"dp" must be'),
        ({"dp": {"gbps": {"all_gather": 0}}}, "must be > 0 GB/s"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=msg):
            load_measured_times(str(path), ["tiny-vit", "tiny-gpt"])


@pytest.mark.parametrize("sp", [False, True])
def test_measured_collectives_replace_the_analytic_tp_bubbles(tmp_path, sp):
    """The executor's measured TP collective times become the backbone layer's TP bubbles, at
    kernel and at layer granularity (the layer's compute measured apart)."""
    from dataclasses import replace

    job = replace(tiny_job(), sequence_parallel=sp)
    kinds = {"all_gather": 0.1, "reduce_scatter": 0.2} if sp else {"all_reduce": 0.3}
    kinds |= {k + "_b": 2 * v for k, v in kinds.items()}
    path = tmp_path / "times.json"
    path.write_text(json.dumps({"tiny-gpt": {"collectives": kinds}}))
    measured = load_measured_times(str(path), ["tiny-vit", "tiny-gpt"])
    layer = JobCosts(job, measured).backbone_layer(job.tp)
    expected_fwd = {"ln1": 0.1, "proj": 0.2, "ln2": 0.1, "fc2": 0.2} if sp else {}
    expected_fwd = expected_fwd or {"proj": 0.3, "fc2": 0.3}
    assert {k.name: k.comm_s for k in layer.fwd if k.comm_s} == pytest.approx(expected_fwd)
    assert sum(k.comm_s for k in layer.bwd) == pytest.approx(2 * sum(expected_fwd.values()))
    measured["tiny-gpt"]["forward"] = {"layer": 1.0}
    unit = JobCosts(job, measured, unit="layer").backbone_layer(job.tp)
    assert [(k.compute_s, k.comm_s) for k in unit.fwd] == [
        (1.0, pytest.approx(sum(expected_fwd.values())))
    ]


def test_sequence_parallel_splits_each_all_reduce():
    spec = BUILTIN_MODELS["gpt-11b"]
    sp = CostModel(get_profile("h100"), 1, sequence_parallel=True).layer_kernels(
        spec, 2048, 4, False
    )
    ar = CostModel(get_profile("h100"), 1, sequence_parallel=False).layer_kernels(
        spec, 2048, 4, False
    )
    assert sum(k.comm_s > 0 for k in sp) == 4 and sum(k.comm_s > 0 for k in ar) == 2
    lat = get_profile("h100").latency_s  # per collective; the bytes moved are the same
    assert sum(k.comm_s for k in sp) - 4 * lat == pytest.approx(sum(k.comm_s for k in ar) - 2 * lat)


def test_chrome_trace_has_a_process_per_rank():
    job = tiny_job(gpus=4, tp=1, pp=2)
    best, _, _ = plan_optimus(JobCosts(job))
    res = simulate(best.schedule, best.workload, keep_spans=True)
    events = chrome_trace_events(res.spans, "optimus")
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"optimus rank 0", "optimus rank 1"}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_kernel_units_from_a_profile_of_whole_units_add_up_to_it():
    """Planning at kernel units from a profile of whole layers (`profile_units`): each layer's
    kernels keep the cost model's proportions and add up to the measured layer; kernels the
    profile names itself keep their measured seconds."""
    job = tiny_job(2, 1, 2)
    name = job.backbone.name
    analytic = JobCosts(job, unit="kernel").backbone_layer(1)
    units = {name: {"forward": {"layer": 0.5}, "backward": {"layer_b": 1.5}}}
    scaled = JobCosts(job, units, unit="kernel").backbone_layer(1)
    for got, want, seconds in ((scaled.fwd, analytic.fwd, 0.5), (scaled.bwd, analytic.bwd, 1.5)):
        assert [k.name for k in got] == [k.name for k in want]
        assert sum(k.compute_s for k in got) == pytest.approx(seconds)
        ratio = seconds / sum(k.compute_s for k in want)
        assert [k.compute_s for k in got] == pytest.approx([k.compute_s * ratio for k in want])
    first = analytic.fwd[0].name
    named = {name: {"forward": {"layer": 0.5, first: 0.25}}}
    kept = JobCosts(job, named, unit="kernel").backbone_layer(1)
    assert kept.fwd[0].compute_s == pytest.approx(0.25)
    assert sum(k.compute_s for k in kept.fwd) != pytest.approx(0.5)


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    """The host's last-level cache is its highest cache level's size in sysfs (K / M units);
    32 MiB where sysfs says nothing."""
    from megatron_mllm.runtime.engine.clock import last_level_cache_bytes

    for index, level, size in (("index0", 1, "32K"), ("index2", 2, "1024K"), ("index3", 3, "16M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes("cpu", tmp_path) == 16 * 2**20
    (tmp_path / "index3" / "size").write_text("\n")  # unreadable: the next level down
    assert last_level_cache_bytes("cpu", tmp_path) == 1024 * 2**10
    assert last_level_cache_bytes("cpu", tmp_path / "absent") == 32 * 2**20


@pytest.mark.parametrize("cold", [True, False])
def test_the_unit_profile_times_every_unit_after_a_cache_flush(cold):
    """`profile_units` runs a flush of twice the last-level cache before every timed call (a
    unit in a step runs cold, after other units, not cache-hot from its own last run);
    `cold=False` (tools/bench_unit_profile.py's ablation) times them without it."""
    from megatron_mllm.runtime.assembly.launch import spawn

    flushers, timed, flushed = spawn(_profile_recording_flushes, 1, cold)[0]
    assert timed >= 10 and (flushers, flushed) == ((1, timed) if cold else (0, 0))


def _profile_recording_flushes(rank: int, world: int, cold: bool) -> tuple[int, int, int]:
    """(flushers made, timed calls, timed calls after the flush) of one tiny `profile_units`
    in this rank process."""
    from megatron_mllm.models.config import TINY
    from megatron_mllm.runtime.engine import clock
    from megatron_mllm.runtime.planning import profile_units as profile

    flushes, calls = [], []

    def flusher(device):
        flushes.append(clock.cache_flusher(device))
        return flushes[-1]

    def median(fn, repeats, device, before=None):
        calls.append(before)
        return clock.median_seconds(fn, repeats, device, before)

    profile.cache_flusher, profile.median_seconds = flusher, median
    profile.profile_units(rank, world, TINY, 1, 1, cold=cold)
    flushed = sum(before is not None and before is flushes[0] for before in calls)
    return len(flushes), len(calls), flushed


def test_the_jobs_own_head_time_prices_the_head_at_either_unit():
    """In-job samples with the LM head timed apart (the last stage's "head" / "head_b"): the
    head block costs what the job measured, at kernel units (the layer's kernels shared out of
    its measured time) as at layer units, instead of the analytic figure."""
    from megatron_mllm.models.config import TINY
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.planning.replan import measured_times
    from megatron_mllm.runtime.planning.schedules import job_of
    from megatron_mllm.schedule.blocks import JobCosts

    job = job_of(TINY, ParallelPlan(1, 1, 2), 1, 4)
    samples = [
        {("llm", "forward", "layer"): [2e-3], ("llm", "backward", "layer_b"): [4e-3]},
        {
            ("llm", "forward", "layer"): [2e-3],
            ("llm", "backward", "layer_b"): [4e-3],
            ("llm", "forward", "head"): [1e-3, 3e-3],
            ("llm", "backward", "head_b"): [5e-3],
        },
    ]
    for unit in ("kernel", "layer"):
        costs = JobCosts(job, measured_times(samples, JobCosts(job, unit=unit), unit), unit)
        head = costs.head(1)
        assert sum(k.compute_s for k in head.fwd) == pytest.approx(2e-3), unit
        assert sum(k.compute_s for k in head.bwd) == pytest.approx(5e-3), unit
