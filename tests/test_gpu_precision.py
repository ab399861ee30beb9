"""On one GPU (tools/gpu_check.sh): bf16 training with megatron-core's distributed optimizer,
peak device memory against the planner's estimate, and the paper layers' per-kernel times at
their TP=8 shapes, saved as measured-times JSON for plan_schedule.py (in $GPU_CHECK_OUT)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.job import (
    Collect,
    DataParts,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
)
from megatron_mllm.runtime.launch import spawn
from megatron_mllm.runtime.reference import make_full_state
from megatron_mllm.runtime.runs import run_rank

pytestmark = pytest.mark.gpu
OUT = Path(os.environ.get("GPU_CHECK_OUT", "out/gpu_check"))
# A mid-size MLLM (~0.4B): ViT 6 x 1024 (patch 14, 448 px: 1024 tokens), GPT 8 x 1536, 512 text
# tokens.
MID = replace(
    TINY,
    image_size=448,
    patch_size=14,
    vit_layers=6,
    vit_hidden=1024,
    vit_heads=16,
    llm_layers=8,
    llm_hidden=1536,
    llm_heads=12,
    vocab_size=32000,
    text_len=512,
)


def _save(name: str, value) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(value, indent=1) + "\n")


def test_bf16_distributed_optimizer_trains_a_mid_size_mllm_within_the_memory_plan():
    """Ten bf16 steps (distributed optimizer, overlapped reduction): the loss falls, nothing is
    NaN or skipped, and torch.cuda.max_memory_allocated is within 0.8-1.5x of the planner's
    estimate (model state + saved activations; the allocator adds workspace and fragments)."""
    from megatron_mllm.runtime.memory import planned_memory
    from megatron_mllm.runtime.schedules import runtime_plan

    plan = ParallelPlan(1, 1, 1)
    state = spawn(make_full_state, 1, MID, 0)[0]
    schedule, workload = runtime_plan(MID, plan, 2, 4, "megatron")
    opt = OptimizerSettings(
        lr=3e-4, clip_grad=1.0, distributed=True, overlap_grad_reduce=True, grad_reduce_in_fp32=True
    )
    job = RuntimeJob(
        ModelParts(MID, state, precision="bf16"),
        PlanParts(plan, schedule),
        DataParts(2, 4),
        steps=10,
        optimizer=opt,
        collect=Collect(grads=False, memory=True),
    )
    (out,) = spawn(run_rank, 1, job)
    means = [sum(h.values()) / len(h) for h in out["history"]]
    planned = planned_memory(schedule, workload)[0]
    estimate = planned["state"] + planned["activations"]
    peak = out["memory"]["device_peak"]
    _save(
        "bf16_mid_size.json",
        {
            "losses": means,
            "memory": out["memory"],
            "planned": planned,
            "peak_vs_plan": peak / estimate,
        },
    )
    assert all(math.isfinite(m) for m in means) and means[-1] < means[0]
    assert out["skipped_iterations"] == 0
    assert 0.8 < peak / estimate < 1.5, (peak, planned)


def test_paper_layers_per_kernel_times_at_tp8_shapes():
    """One ViT-22B and one GPT-175B layer at TP=8 shapes (micro-batch 2; 1024 and 2048
    tokens), bf16, forward and backward per kernel with CUDA events: every time positive, and
    the JSON loads as plan_schedule.py's --measured-times."""
    from megatron_mllm.schedule.cost_model import load_measured_times

    times = spawn(_kernel_times, 1)[0]
    path = OUT / "measured_times_h200_tp8.json"
    _save(path.name, times)
    for model in times.values():
        assert all(v > 0 for d in model.values() for v in d.values()), model
    assert set(load_measured_times(str(path), list(times))) == set(times)


def _kernel_times(rank: int, world: int) -> dict:
    import torch

    from megatron_mllm.runtime.bootstrap import init_rank
    from megatron_mllm.runtime.profile_kernels import kernel_times
    from megatron_mllm.schedule.specs import BUILTIN_MODELS

    device = init_rank(rank, world, 0, 600.0)
    return {
        name: kernel_times(BUILTIN_MODELS[name], 8, 2, seq, torch.bfloat16, device, repeats=5)
        for name, seq in (("vit-22b", 1024), ("gpt-175b", 2048))
    }
