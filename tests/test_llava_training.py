"""Training on LLaVA-format conversations streamed through energon: micro-batches with 0 to 4
images each (text-only samples skip the encoder) give the one-process reference's losses and
gradients under PP=2 (megatron-core's 1F1B, our executor on the Megatron, balanced and Optimus
schedules) and TP=2. Optimus is planned for one image per sample (the planner's load today)."""

from dataclasses import replace

import pytest
import torch
from test_runtime import TRAIN, check_against, check_grads, check_later_losses

from megatron_mllm.data.llava_source import LlavaData
from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.inputs.batches import StepData
from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob, encoder_plan_of
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.modes.runs import run_rank
from megatron_mllm.runtime.planning.schedules import runtime_schedule

pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
SEQ, MB, N = 64, 2, 3  # sequence (image tokens included), micro-batch, micro-batches a step
# Three steps: the third holds a micro-batch without images after two steps without one.
STEPS = {**TRAIN, "steps": 3}
CFG = replace(TINY, text_len=SEQ - TINY.image_tokens, vocab_size=384)


@pytest.fixture(scope="module")
def data(llava_dataset):
    path, tokenizer = llava_dataset
    return LlavaData(str(path), str(tokenizer), SEQ, num_workers=1)


@pytest.fixture(scope="module")
def references(data):
    """dp -> (weights, the one-process reference over `dp` replicas' streams), made once."""
    state, made = spawn(make_full_state, 1, CFG, 0)[0], {}

    def reference(dp: int):
        if dp not in made:
            job = RuntimeJob(
                ModelParts(CFG, state),
                PlanParts(ParallelPlan(dp, 1, 1)),
                DataParts(MB, N, llava=data),
                mode="reference",
                **STEPS,
            )
            made[dp] = state, spawn(run_rank, 1, job)[0]
        return made[dp]

    return reference


def test_the_steps_hold_mixed_image_counts(data):
    job = RuntimeJob(
        ModelParts(CFG, {}), PlanParts(ParallelPlan(1, 1, 1)), DataParts(MB, N, llava=data)
    )
    stream = StepData(job, [0])
    counts = [stream.step(s)(m).num_images for s in range(2) for m in range(N)]
    stream.close()
    assert 0 in counts and len(set(counts)) >= 3, counts


def _layout(plan, schedule_name):
    if schedule_name == "megatron_core":
        return PlanParts(plan), {"backbone": plan.tp, "encoder": plan.tp, "projector": plan.tp}
    schedule = runtime_schedule(CFG, plan, MB, N, schedule_name)
    enc_plan, stage0 = encoder_plan_of(schedule, plan)
    etp = plan.tp if stage0 else enc_plan.tp
    return PlanParts(plan, schedule=schedule), {
        "backbone": plan.tp,
        "encoder": etp,
        "projector": etp,
    }


@pytest.mark.parametrize(
    "plan, schedule_name",
    [
        (ParallelPlan(1, 1, 2), "optimus"),
        pytest.param(ParallelPlan(1, 1, 2), "megatron", marks=pytest.mark.slow),
        (ParallelPlan(2, 1, 1), "megatron"),  # replicas whose micro-batches differ in images
        pytest.param(ParallelPlan(1, 1, 2), "balanced", marks=pytest.mark.slow),
        pytest.param(ParallelPlan(1, 1, 2), "megatron_core", marks=pytest.mark.slow),
        pytest.param(ParallelPlan(1, 2, 1), "optimus", marks=pytest.mark.slow),
    ],
    ids=[
        "pp2-optimus",
        "pp2-megatron",
        "dp2-megatron",
        "pp2-balanced",
        "pp2-megatron-core",
        "tp2-optimus",
    ],
)
def test_mixed_image_counts_agree_with_the_reference(references, data, plan, schedule_name):
    """Also with overlapped DDP reductions: a micro-batch without images runs no encoder
    backward, yet every bucket still starts after the step's last backward."""
    reference = references(plan.dp)
    parts, tp_of = _layout(plan, schedule_name)
    mode = "megatron_core" if schedule_name == "megatron_core" else "executor"
    optimizer = STEPS["optimizer"]
    if mode == "executor":
        optimizer = replace(optimizer, overlap_grad_reduce=True, ddp_bucket_size=20_000)
    job = RuntimeJob(
        ModelParts(CFG, reference[0]),
        parts,
        DataParts(MB, N, llava=data),
        mode=mode,
        **{**STEPS, "optimizer": optimizer},
    )
    outs = spawn(run_rank, plan.world_size, job)
    check_against(reference, outs, tp_of)
    for step in (1, 2):  # later steps' data, after optimizer steps
        after = {k: v for o in outs for k, v in o["history"][step].items()}
        for k, v in reference[1]["history"][step].items():
            assert after[k] == pytest.approx(v, abs=1e-4)


def test_optimus_is_planned_for_the_data_sets_average_load(llava_dataset):
    """The converter records the training split's mean images per sample; the planner's
    encoder work scales with it (text-only samples count 0)."""
    from megatron_mllm.data.energon_llava import images_per_sample
    from megatron_mllm.runtime.planning.schedules import job_of
    from megatron_mllm.schedule.blocks import JobCosts

    load = images_per_sample(llava_dataset[0])
    assert load == pytest.approx(1.0)  # the digits' sources take 1, 2, 1 and 0 images in turn
    load = 1.7
    plan = ParallelPlan(1, 1, 2)
    costs = {x: JobCosts(job_of(CFG, plan, MB, N, images_per_sample=x), unit="layer")
             for x in (1.0, load)}  # fmt: skip
    one, mean = (sum(k.total_s for b in c.encoder_blocks(0, 1) for k in b.fwd)
                 for c in costs.values())  # fmt: skip
    assert mean == pytest.approx(one * load)
    heavy, light = (runtime_schedule(CFG, plan, MB, N, "optimus", images_per_sample=x)
                    for x in (4.0, 0.25))  # fmt: skip
    assert heavy.ranks != light.ranks or heavy.meta != light.meta


def test_per_step_plans_keep_the_references_losses(data):
    """optimus-adaptive: from the second step on, each step runs its own plan (made in the
    background one step ahead from its micro-batches' image counts), its micro-batches in
    other 1F1B slots; every micro-batch's loss and, through the next steps' losses, the
    reduced gradient stay the reference's (with overlapped DDP reduction)."""
    n = 4  # with these data, step 2's plan moves its heaviest micro-batch to the first slot
    state = spawn(make_full_state, 1, CFG, 0)[0]
    one = ParallelPlan(1, 1, 1)
    ref_job = RuntimeJob(
        ModelParts(CFG, state), PlanParts(one), DataParts(MB, n, llava=data), mode="reference",
        **STEPS,
    )  # fmt: skip
    reference = state, spawn(run_rank, 1, ref_job)[0]
    plan = ParallelPlan(1, 1, 2)
    # The encoder on both stages (the planner keeps it on stage 0 for so few micro-batches).
    outs = _adaptive_run_agrees(reference, plan, n, data, ddp_bucket_size=20_000)
    stats = [o["step_plans"] for o in outs]
    assert all(s.planned + s.fallbacks == 3 and not s.failures for s in stats)
    assert stats[0].planned == stats[1].planned >= 2  # the first step is planned before it runs
    orders = outs[0]["step_orders"]
    assert orders[0] is not None and orders == outs[1]["step_orders"]
    assert any(o is not None and o != sorted(o) for o in orders), orders  # slots really moved


@pytest.mark.slow
def test_per_step_plans_per_replica_keep_the_references_losses(references, data):
    """optimus-adaptive at DP 2: each replica plans for its own micro-batches' images (their
    plans may differ); the reduced gradient is the reference's (same losses after it)."""
    outs = _adaptive_run_agrees(references(2), ParallelPlan(2, 1, 1), N, data)
    assert all(o["step_plans"].planned + o["step_plans"].fallbacks == 3 for o in outs)


def _adaptive_run_agrees(reference, plan, n, data, **optimizer):
    """An optimus-adaptive run (the encoder colocated: DP 2 TP 1 PP 1 over the plan's ranks,
    overlapped DDP reduction) against `reference`: step 0's losses and gradients, and every
    later step's losses. Returns the ranks' results."""
    from megatron_mllm.runtime.job import ExecutorSettings

    schedule = runtime_schedule(CFG, plan, MB, n, "optimus", encoder_plan=ParallelPlan(2, 1, 1))
    knobs = replace(STEPS["optimizer"], overlap_grad_reduce=True, **optimizer)
    job = RuntimeJob(
        ModelParts(CFG, reference[0]),
        PlanParts(plan, schedule=schedule),
        DataParts(MB, n, llava=data),
        executor=ExecutorSettings(adaptive=True),
        **{**STEPS, "optimizer": knobs},
    )
    outs = spawn(run_rank, plan.world_size, job)
    check_against(reference, outs, {"backbone": 1, "encoder": 1, "projector": 1})
    check_later_losses(reference, outs)
    return outs


def _per_token_reference(state, data, dp: int, n: int = N, dealt: bool = False) -> tuple:
    job = RuntimeJob(
        ModelParts(CFG, state),
        PlanParts(ParallelPlan(dp, 1, 1)),
        DataParts(MB, n, llava=data, per_token_loss=True, balance_samples=dealt),
        mode="reference",
        **STEPS,
    )
    return state, spawn(run_rank, 1, job)[0]


@pytest.mark.parametrize("dp", [1, 2])
def test_balanced_samples_deal_the_same_samples_into_even_micro_batches(data, dp):
    """Each step's samples, dealt anew over every replica: the same samples, micro-batches of
    the same size, and image counts per micro-batch no further apart than the heaviest sample
    (here: closer); at DP 2 some samples change replica."""
    n = 4
    plain, even = (
        StepData(
            RuntimeJob(
                ModelParts(CFG, {}),
                PlanParts(ParallelPlan(dp, 1, 1)),
                DataParts(MB, n, llava=data, per_token_loss=True, balance_samples=balance),
            ),
            list(range(dp)),
        )
        for balance in (False, True)
    )
    spread, crossed = {False: 0, True: 0}, 0
    for step in range(3):
        got = [_replicas(s.step(step), n, dp) for s in (plain, even)]
        before, after = ([b for r in x for b in r] for x in got)
        assert sorted(i for b in before for i in b.ids) == sorted(i for b in after for i in b.ids)
        assert all(b.num_samples == MB for b in after)
        assert sum(b.labelled_tokens for b in before) == sum(b.labelled_tokens for b in after)
        heaviest = max(c for b in before for c in b.images_per_sample())
        counts = {False: [b.num_images for b in before], True: [b.num_images for b in after]}
        assert max(counts[True]) - min(counts[True]) <= heaviest
        for k, c in counts.items():
            spread[k] += max(c) - min(c)
        mine = [{i for b in replica for i in b.ids} for replica in got[0]]
        crossed += sum(len({i for b in got[1][r] for i in b.ids} - mine[r]) for r in range(dp))
    plain.close()
    even.close()
    assert spread[True] < spread[False], spread
    assert (crossed > 0) == (dp > 1)


def _replicas(get, n: int, dp: int) -> list[list]:
    return [[get(m, r) for m in range(n)] for r in range(dp)]


@pytest.mark.slow  # 11 s; samples dealt across replicas covers the per-token path
def test_per_token_loss_with_balanced_samples_keeps_the_references_gradient(references, data):
    """--calculate-per-token-loss with optimus-adaptive: each step's samples are dealt into
    micro-batches of equal image counts, which changes every micro-batch's loss but not the
    per-token loss of the step nor its gradient: step 0's gradients and every step's mean loss
    are those of the one-process per-token reference on the loader's micro-batches. The
    per-token gradient is not the per-micro-batch mean's (so the test tells them apart)."""
    from megatron_mllm.runtime.job import ExecutorSettings

    state = references(1)[0]
    reference = _per_token_reference(state, data, 1)
    mean_grads, token_grads = references(1)[1]["grads"], reference[1]["grads"]
    assert any(not torch.allclose(mean_grads[k][0], token_grads[k][0]) for k in token_grads)
    plan = ParallelPlan(1, 1, 2)
    schedule = runtime_schedule(CFG, plan, MB, N, "optimus", encoder_plan=ParallelPlan(2, 1, 1))
    job = RuntimeJob(
        ModelParts(CFG, state),
        PlanParts(plan, schedule=schedule),
        DataParts(MB, N, llava=data, per_token_loss=True, balance_samples=True),
        executor=ExecutorSettings(adaptive=True),
        **{**STEPS, "optimizer": replace(STEPS["optimizer"], overlap_grad_reduce=True)},
    )
    outs = spawn(run_rank, plan.world_size, job)
    check_grads(reference, outs, {"backbone": 1, "encoder": 1, "projector": 1})
    for step in range(STEPS["steps"]):
        assert outs[0]["mean_losses"][step] == pytest.approx(
            reference[1]["mean_losses"][step], abs=1e-5
        )
    moved = {k: v for o in outs for k, v in o["history"][0].items()}
    assert any(abs(moved[k] - v) > 1e-3 for k, v in reference[1]["history"][0].items())


@pytest.mark.slow  # the dealt run below checks our executor's DP 2 per-token gradient too
@pytest.mark.parametrize("mode", ["executor", "megatron_core"])
def test_per_token_loss_over_two_replicas_is_the_references(data, references, mode):
    """At DP 2 every token of the global batch weighs the same: each replica's loss sums are
    divided by both replicas' labelled tokens (a DP all-reduce), not by its own; on our
    executor and on megatron-core's own schedule (its per-token loss contract)."""
    reference = _per_token_reference(references(2)[0], data, 2)
    plan = ParallelPlan(2, 1, 1)
    parts = PlanParts(plan, schedule=runtime_schedule(CFG, plan, MB, N, "megatron"))
    job = RuntimeJob(
        ModelParts(CFG, reference[0]),
        parts if mode == "executor" else PlanParts(plan),
        DataParts(MB, N, llava=data, per_token_loss=True),
        mode=mode,
        **STEPS,
    )
    outs = spawn(run_rank, plan.world_size, job)
    check_against(reference, outs, {"backbone": 1, "encoder": 1, "projector": 1})
    for step in (1, 2):  # after updates made with the per-token gradient (megatron-core
        # scales the summed gradient after its reduction: last bits differ, Adam shows them)
        after = {k: v for o in outs for k, v in o["history"][step].items()}
        assert after == pytest.approx(reference[1]["history"][step], rel=1e-4)


def test_samples_dealt_across_replicas_keep_the_references_gradient(data, references):
    """DP 2, per-token loss: both replicas' samples dealt by images across the replicas, each
    process sending only the samples that change replica. Every micro-batch's loss is the one
    of the one-process reference that deals both streams the same way, and step 0's gradient is
    the per-token reference's on the loader's own micro-batches (the global batch is the same
    samples)."""
    state = references(2)[0]
    plain = _per_token_reference(state, data, 2)
    dealt = _per_token_reference(state, data, 2, dealt=True)
    plan = ParallelPlan(2, 1, 1)
    job = RuntimeJob(
        ModelParts(CFG, state),
        PlanParts(plan, schedule=runtime_schedule(CFG, plan, MB, N, "megatron")),
        DataParts(MB, N, llava=data, per_token_loss=True, balance_samples=True),
        **STEPS,
    )
    outs = spawn(run_rank, plan.world_size, job)
    one = {"backbone": 1, "encoder": 1, "projector": 1}
    check_against(dealt, outs, one)
    check_grads(plain, outs, one)
    assert dealt[1]["losses"] != pytest.approx(plain[1]["losses"], abs=1e-3)  # samples moved
    for step in (1, 2):
        after = {k: v for o in outs for k, v in o["history"][step].items()}
        assert after == pytest.approx(dealt[1]["history"][step], abs=1e-4)
