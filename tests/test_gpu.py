"""The CUDA/NCCL path (run by `make gpu-check`, or tools/gpu_check.sh on the GPU machine).

Every run here is on CUDA, the reference included (it runs on the job's device), with TF32 off
in every rank, and is compared with the reference at fp32 tolerances: step-0 losses, every
gradient, and (where the run trains) the losses after the optimizer step. On one GPU: our
executor and megatron-core's own schedule. On two: PP=2 (Optimus's tagless NCCL matching, which
the executor's ordered mode handles), TP=2 with TP-bubble fills inside NCCL collectives, with
and without sequence parallelism, and DP=2. On four: PP=2 x TP=2.

A test marked gpus(n) skips with fewer than n GPUs, and fails under gpu-check (see conftest)."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.models.weights import assemble_grads
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
    encoder_plan_of,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.modes.runs import run_rank
from megatron_mllm.runtime.planning.schedules import runtime_schedule

pytestmark = pytest.mark.gpu
N = 4  # micro-batches
TRAIN = dict(
    steps=2, optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.5)
)  # an optimizer step between the two steps
RTOL, ATOL = 1e-4, 1e-5  # fp32 (TF32 off): only the order of the sums differs
ATOL_AFTER_STEP = 1e-4  # Adam normalises each update, so tiny gradient differences grow a bit


def _fp32(rank: int, world: int, fn, *args):
    """`fn(rank, world, *args)` in a spawned rank with TF32 off (cuBLAS and cuDNN)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return fn(rank, world, *args)


def _spawn(fn, world: int, *args):
    return spawn(_fp32, world, fn, *args)


@functools.cache
def _state() -> dict[str, torch.Tensor]:
    """The canonical weights from seed 0 (one per session: each spawn costs start-up time)."""
    return _spawn(make_full_state, 1, TINY, 0)[0]


@functools.cache
def _reference(dp: int) -> dict:
    """The one-process reference on this GPU for `dp` replicas' micro-batches, two steps."""
    plan = ParallelPlan(dp, 1, 1)
    job = RuntimeJob(
        ModelParts(TINY, _state()), PlanParts(plan), DataParts(1, N), mode="reference", **TRAIN
    )
    return _spawn(run_rank, 1, job)[0]


def _merged(outs: list[dict], key: str, step: int | None = None) -> dict:
    merged = {}
    for o in outs:
        merged.update(o[key] if step is None else o[key][step])
    return merged


def _check_losses(got: dict, expected: dict, atol: float, what: str) -> None:
    assert set(got) == set(expected), what
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=RTOL, abs=atol), f"{what} {k}"


def _check_grads(outs: list[dict], ref: dict, tp_of: dict[str, int], every: bool = True) -> None:
    """The full gradients assembled from `outs`' shards against the reference's; `every`: the
    shards must cover every parameter."""
    shapes = {k: v.shape for k, v in _state().items()}
    shards = [
        {k: (g.detach().cpu(), r, gated) for k, (g, r, gated) in o["grads"].items()} for o in outs
    ]
    grads = assemble_grads(shards, shapes, {k: tp_of[k.split(".")[0]] for k in shapes})
    if every:
        missing = set(shapes) - set(grads)
        assert not missing, f"no rank returned a gradient for {sorted(missing)}"
        assert set(ref["grads"]) == set(shapes)
    for name, got in grads.items():
        expected = ref["grads"][name][0].detach().cpu()
        torch.testing.assert_close(
            got.float(), expected.float(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check_against(outs: list[dict], ref: dict, tp_of: dict[str, int]) -> None:
    """Step-0 losses, every gradient, and every later step's losses (after the optimizer step
    clipped by the whole model's norm) against the reference."""
    _check_losses(_merged(outs, "losses"), ref["losses"], ATOL, "step-0 losses")
    _check_grads(outs, ref, tp_of)
    steps = len(outs[0]["history"])
    assert all(len(o["history"]) == steps for o in outs)
    for step in range(1, steps):
        expected = ref["history"][step]
        _check_losses(_merged(outs, "history", step), expected, ATOL_AFTER_STEP, f"step {step}")


def _executor(
    plan: ParallelPlan, name: str, unit: str = "layer", sp: bool = False, overlap: bool = False
) -> list[dict]:
    """Our executor on `plan` (one GPU a rank) with the `name` schedule, checked against the
    reference; returns the ranks' results."""
    schedule = runtime_schedule(TINY, plan, 1, N, name, unit=unit, sequence_parallel=sp)
    job = RuntimeJob(
        ModelParts(TINY, _state()),
        PlanParts(plan, schedule, unit, sp),
        DataParts(1, N),
        **TRAIN,
        executor=ExecutorSettings(overlap_tp_fills=overlap),
    )
    outs = _spawn(run_rank, plan.world_size, job)
    assert len(outs[0]["history"]) == TRAIN["steps"]
    enc_plan, stage0 = encoder_plan_of(schedule, plan)
    etp = plan.tp if stage0 else enc_plan.tp
    _check_against(
        outs, _reference(plan.dp), {"backbone": plan.tp, "encoder": etp, "projector": etp}
    )
    return outs


@pytest.mark.parametrize("name", ["megatron", "optimus"])
def test_executor_on_one_gpu_matches_the_reference(name):
    _executor(ParallelPlan(1, 1, 1), name)


def test_megatron_core_on_one_gpu_matches_the_reference():
    """megatron-core's own schedule (no optimizer of ours: step-0 losses and gradients)."""
    plan = ParallelPlan(1, 1, 1)
    outs = _spawn(
        run_rank,
        1,
        RuntimeJob(
            ModelParts(TINY, _state()), PlanParts(plan), DataParts(1, N), mode="megatron_core"
        ),
    )
    ref = _reference(1)
    _check_losses(_merged(outs, "losses"), ref["losses"], ATOL, "step-0 losses")
    _check_grads(outs, ref, {"backbone": 1, "encoder": 1, "projector": 1})


@pytest.mark.gpus(2)
@pytest.mark.parametrize("name", ["megatron", "optimus"])
def test_pipeline_over_nccl_matches_the_reference(name):
    _executor(ParallelPlan(1, 1, 2), name)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("sp", [False, True], ids=["all-reduce", "sequence-parallel"])
def test_tp_fills_run_inside_nccl_collectives(sp):
    """TP=2 over NCCL: encoder kernels run on the compute stream while the backbone's TP
    collectives (with SP: all-gathers and reduce-scatters) run on NCCL's."""
    plan = ParallelPlan(1, 2, 1)
    outs = _executor(plan, "optimus", "kernel", sp=sp, overlap=True)
    assert sum(o["overlapped"] for o in outs) > 0


@pytest.mark.gpus(2)
@pytest.mark.parametrize("name", ["megatron", "optimus"])
def test_data_parallel_over_nccl_matches_the_reference(name):
    """DP=2: each replica's micro-batches, gradients all-reduced over NCCL; every replica
    holds the reference's gradients, not only the one assembled from."""
    outs = _executor(ParallelPlan(2, 1, 1), name)
    for o in outs:
        _check_grads([o], _reference(2), {"backbone": 1, "encoder": 1, "projector": 1}, False)


@pytest.mark.gpus(4)
@pytest.mark.parametrize("name", ["megatron", "optimus"])
def test_pipeline_and_tensor_parallel_on_four_gpus(name):
    """PP=2 x TP=2 with sequence parallelism: [s/tp, b, h] activations between the stages."""
    _executor(ParallelPlan(1, 2, 2), name, sp=True)
