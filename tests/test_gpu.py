"""The CUDA/NCCL path (run by `make gpu-check`; skipped without CUDA). On one GPU: the executor
on CUDA against the CPU reference. On two or more: PP=2 Optimus over NCCL, whose tagless
matching the executor's ordered mode handles (see test_runtime's ordered-p2p test on gloo), and
TP=2 with TP-bubble fills inside NCCL collectives, with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.job import RuntimeJob
from megatron_mllm.runtime.launch import spawn
from megatron_mllm.runtime.reference import make_full_state
from megatron_mllm.runtime.schedules import runtime_schedule
from megatron_mllm.runtime.session import run_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
N = 4


def _losses_match(plan: ParallelPlan, name: str, unit: str = "layer", **job_fields) -> list:
    state = spawn(make_full_state, 1, TINY, 0)[0]
    ref = spawn(run_rank, 1, RuntimeJob(TINY, ParallelPlan(1, 1, 1), 1, N, state, mode="reference"))
    sp = job_fields.get("sequence_parallel", False)
    schedule = runtime_schedule(TINY, plan, 1, N, name, unit=unit, sequence_parallel=sp)
    job = RuntimeJob(TINY, plan, 1, N, state, schedule=schedule, encoder_units=unit, **job_fields)
    outs = spawn(run_rank, plan.world_size, job)
    losses = {k: v for o in outs for k, v in o["losses"].items()}
    assert set(losses) == set(ref[0]["losses"])
    for k, v in ref[0]["losses"].items():  # CPU reference vs CUDA kernels: fp32 tolerance
        assert losses[k] == pytest.approx(v, rel=1e-4)
    return outs


def test_executor_on_one_gpu_matches_the_cpu_reference():
    _losses_match(ParallelPlan(1, 1, 1), "megatron")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["megatron", "optimus"])
def test_pipeline_over_nccl_matches_the_reference(name):
    _losses_match(ParallelPlan(1, 1, 2), name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("sp", [False, True], ids=["all-reduce", "sequence-parallel"])
def test_tp_fills_run_inside_nccl_collectives(sp):
    """TP=2 over NCCL: encoder kernels run on the compute stream while the backbone's TP
    collectives (with SP: all-gathers and reduce-scatters) run on NCCL's."""
    outs = _losses_match(
        ParallelPlan(1, 2, 1), "optimus", "kernel", overlap_tp_fills=True, sequence_parallel=sp
    )
    assert sum(o["overlapped"] for o in outs) > 0
