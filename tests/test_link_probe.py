"""The plan candidates' message latency: measured between two pipeline stages, not fitted."""

from __future__ import annotations

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
from megatron_mllm.runtime.planning.link_probe import (
    activation_shape,
    message_latency,
    message_seconds,
    probe_pair,
)


def _job(plan: ParallelPlan, micro_batch: int = 2) -> RuntimeJob:
    return RuntimeJob(ModelParts(TINY, {}), PlanParts(plan), DataParts(micro_batch, 4))


def _probe(rank: int, world: int, jobs: list[RuntimeJob]) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [message_seconds(j, torch.device("cpu"), torch.bfloat16, rounds=3) for j in jobs]
    pair = {(0, 1): dist.new_group([0, 1])}  # ordered messages: the pair's own group
    return [*out, message_seconds(jobs[0], torch.device("cpu"), torch.bfloat16, 3, pair)]


def test_the_latency_is_what_the_model_does_not_already_charge():
    assert message_latency(3e-3, 1e-3) == pytest.approx(2e-3)
    assert message_latency(1e-3, 3e-3) == 0.0


def test_the_pair_and_message_are_a_backbone_activation_between_stages_0_and_1():
    job = _job(ParallelPlan(1, 1, 2))
    assert probe_pair(job) == (0, 1)
    assert activation_shape(job) == (TINY.seq_len, 2, TINY.llm_hidden)
    assert probe_pair(_job(ParallelPlan(1, 2, 1))) is None  # a pipeline of one sends none


def test_every_rank_gets_the_first_stage_measurement():
    (pp2, dp2, own), (pp2_, dp2_, own_) = spawn(
        _probe, 2, [_job(ParallelPlan(1, 1, 2)), _job(ParallelPlan(1, 2, 1))]
    )
    assert pp2 == pp2_ and 0 < pp2 < 1.0
    assert dp2 == dp2_ == 0.0
    assert own == own_ and 0 < own < 1.0
