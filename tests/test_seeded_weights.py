"""Initial weights drawn per tensor from the seed and its name (models/weights.py SeededState):
the same weights under every layout, and each rank draws only its part's tensors."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.models.weights import assemble_grads
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
from megatron_mllm.runtime.planning.schedules import runtime_schedule

N = 4
# A backbone much larger than the encoder, so that a pipeline stage's half shows.
BIG = replace(TINY, llm_layers=4, llm_hidden=256, llm_heads=4)


def _seeded(rank: int, world: int, cfg, seed: int):
    """The SeededState itself (names and shapes only: nothing drawn)."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import seeded_state

    init_rank(rank, world, seed, 60)
    out = seeded_state(cfg, seed)
    assert not out.made
    return out


def _run_and_count(rank: int, world: int, job):
    """`run_rank`, and which tensors of the job's SeededState this rank drew."""
    out = run_rank(rank, world, job)
    out["drawn"] = job.model.weights.made_bytes()
    return out


@pytest.fixture(scope="module")
def seeded():
    return spawn(_seeded, 1, BIG, 0)[0]


def _loaded(seeded, plan: ParallelPlan, name: str) -> tuple[dict, list[dict]]:
    """Every parameter as the ranks of `plan` loaded it (assembled), and each rank's result."""
    schedule = runtime_schedule(BIG, plan, 1, N, name)
    job = RuntimeJob(
        ModelParts(BIG, seeded),
        PlanParts(plan, schedule),
        DataParts(1, N),
        steps=1,
        optimizer=OptimizerSettings(lr=0.0),  # the step leaves the loaded weights as they were
        collect=Collect(params=True),
    )
    outs = spawn(_run_and_count, plan.world_size, job)
    shapes = dict(seeded.shapes)
    return assemble_grads([o["params"] for o in outs], shapes, dict.fromkeys(shapes, plan.tp)), outs


def test_two_layouts_load_the_same_weights_and_a_stage_draws_its_part(seeded):
    """PP 2 (Megatron schedule: the encoder on stage 0) and TP 2 load, name by name, the
    tensors the seed gives in one process; under PP 2 each rank draws only its stage's
    tensors (the last stage, half the backbone and no encoder, well under the whole model),
    and every tensor is drawn by exactly one stage."""
    whole = spawn(make_full_state, 1, BIG, 0)[0]
    total = sum(4 * v.numel() for v in whole.values())
    pp, pp_outs = _loaded(seeded, ParallelPlan(1, 1, 2), "megatron")
    tp, _ = _loaded(seeded, ParallelPlan(1, 2, 1), "megatron")
    for name, value in whole.items():
        assert torch.equal(pp[name].float(), value), name
        assert torch.equal(tp[name].float(), value), name
    drawn = [o["drawn"] for o in pp_outs]
    assert sum(drawn) == total, (drawn, total)
    assert drawn[1] < 0.5 * total, (drawn, total)


def test_the_seeded_weights_follow_megatron_cores_initialisation(seeded):
    """Norm weights 1, biases 0, weights of std 0.02 with the output projections scaled by
    1/sqrt(2 x layers): the statistics megatron-core's own initialisation gives."""
    std = {k: float(seeded[k].std()) for k in seeded if seeded.shapes[k][0] > 64}
    assert std["backbone.decoder.layers.0.mlp.linear_fc1.weight"] == pytest.approx(0.02, rel=0.05)
    out = std["backbone.decoder.layers.0.mlp.linear_fc2.weight"]
    assert out == pytest.approx(0.02 / (2 * BIG.llm_layers) ** 0.5, rel=0.05)
    assert torch.equal(seeded["backbone.decoder.final_layernorm.weight"], torch.ones(256))
    assert torch.equal(seeded["backbone.decoder.final_layernorm.bias"], torch.zeros(256))
    again = spawn(_seeded, 1, BIG, 0)[0]
    name = "encoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(again[name], seeded[name])
    other = spawn(_seeded, 1, BIG, 1)[0]
    assert not torch.equal(other[name], seeded[name])


def _resident(field: str) -> int:
    """Bytes of /proc/self/status's `field` (VmRSS: now; VmHWM: the peak since its reset)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field))
    return 1024 * int(line.split()[1])


def _build_rss_growth(rank: int, world: int, job) -> int:
    """`run_rank` for one step, returning the peak resident bytes this rank gained while its
    model was built and loaded from the job's SeededState. Large blocks are mapped apart and
    returned when freed (glibc's mmap and trim thresholds), the peak is reset just before
    (Linux's clear_refs), after a warm-up build (imports and buffers every build shares)."""
    import ctypes

    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.model_builder import build_full_model
    from megatron_mllm.runtime.modes import executor_run

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    grown, build = [], executor_run.build_job_model

    def measured(*args, **kwargs):
        solo = [dist.new_group([r]) for r in range(world)][rank]  # collective, in one order
        build_full_model(TINY, group=solo)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from now
        before = _resident("VmRSS:")
        model = build(*args, **kwargs)
        grown.append(_resident("VmHWM:") - before)
        return model

    executor_run.build_job_model = measured
    run_rank(rank, world, job)
    return grown[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's peak RSS")
@pytest.mark.slow  # 26 s; make test stays under 5 minutes
def test_a_stages_start_up_memory_follows_its_part_not_the_whole_model():
    """Measured in real jobs (~100M fp32 backbone parameters): the peak memory a rank gains
    while its model is built and loaded is, for the last of two pipeline stages (half the
    backbone, no encoder), about half of what one rank holding the whole model gains (442 MB
    against 236 MB here); drawing the whole model first, as before, would cost it more than
    the whole model alone."""
    big = replace(TINY, llm_layers=8, llm_hidden=1024, llm_heads=8)
    grown = {}
    for plan in (ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 2)):
        weights = spawn(_seeded, 1, big, 0)[0]
        job = RuntimeJob(
            ModelParts(big, weights),
            PlanParts(plan, runtime_schedule(big, plan, 1, N, "megatron")),
            DataParts(1, N),
            steps=1,
        )
        grown[plan.pp] = spawn(_build_rss_growth, plan.world_size, job)
    whole, last = grown[1][0], grown[2][1]
    assert whole > 400e6, grown  # the whole model's 400 MB of parameters at least
    assert last < 0.7 * whole, grown
