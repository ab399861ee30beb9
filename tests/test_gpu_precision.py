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
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    Collect,
    DataParts,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.modes.runs import run_rank

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


def _write_full_state(rank: int, world: int, cfg, seed: int, path: str) -> str:
    """The canonical weights written to `path` by the child that made them: a mid-size state
    (1.6 GB) never travels as a spawn argument or result through /dev/shm."""
    from megatron_mllm.models.weights import save_full_state

    return save_full_state(make_full_state(rank, world, cfg, seed), path)


def bf16_steps_within_the_memory_plan(cfg, tmp_path, steps: int) -> dict:
    """`steps` bf16 steps (distributed optimizer, overlapped reduction) on one rank from a
    weights file: the loss falls, nothing is NaN or skipped, and memory matches the plan part
    by part: model states (parameters, gradient buffers, optimizer) within 10% of the
    planner's, saved activations within 0.5-2x (autograd's choice of what to save is not the
    cost model's count); on a GPU the allocator's peak is at least both and at most 1.5x."""
    from megatron_mllm.runtime.assembly.memory import planned_memory
    from megatron_mllm.runtime.planning.schedules import runtime_plan

    plan = ParallelPlan(1, 1, 1)
    weights = spawn(_write_full_state, 1, cfg, 0, str(tmp_path / "weights.pt"))[0]
    schedule, workload = runtime_plan(cfg, plan, 2, 4, "megatron")
    opt = OptimizerSettings(
        lr=3e-4, clip_grad=1.0, distributed=True, overlap_grad_reduce=True, grad_reduce_in_fp32=True
    )
    job = RuntimeJob(
        ModelParts(cfg, weights, precision="bf16"),
        PlanParts(plan, schedule),
        DataParts(2, 4),
        steps=steps,
        optimizer=opt,
        collect=Collect(grads=False, memory=True),
    )
    (out,) = spawn(run_rank, 1, job)
    means = [sum(h.values()) / len(h) for h in out["history"]]
    planned = planned_memory(schedule, workload)[0]
    memory = out["memory"]
    state = memory["params"] + memory["grads"] + memory["optimizer"]
    assert all(math.isfinite(m) for m in means) and means[-1] < means[0]
    assert out["skipped_iterations"] == 0
    assert 0.9 < state / planned["state"] < 1.1, (memory, planned)
    assert 0.5 < memory["activations"] / planned["activations"] < 2.0, (memory, planned)
    if "device_peak" in memory:
        assert state + memory["activations"] <= memory["device_peak"], (memory, planned)
        assert memory["device_peak"] < 1.5 * (planned["state"] + planned["activations"]), memory
    return {"losses": means, "memory": memory, "planned": planned}


def test_bf16_distributed_optimizer_trains_a_mid_size_mllm_within_the_memory_plan(tmp_path):
    """Ten bf16 steps of the ~0.4B MLLM on the GPU within the memory plan, part by part."""
    _save("bf16_mid_size.json", bf16_steps_within_the_memory_plan(MID, tmp_path, steps=10))


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

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.planning.profile_kernels import kernel_times
    from megatron_mllm.schedule.specs import BUILTIN_MODELS

    device = init_rank(rank, world, 0, 600.0)
    return {
        name: kernel_times(BUILTIN_MODELS[name], 8, 2, seq, torch.bfloat16, device, repeats=5)
        for name, seq in (("vit-22b", 1024), ("gpt-175b", 2048))
    }
