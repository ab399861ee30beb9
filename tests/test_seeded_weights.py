"""Initial weights drawn per tensor from the seed and its name (models/weights.py SeededState):
the same weights under every layout, and each rank draws only its part's tensors."""

from __future__ import annotations

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
