"""The plan candidates' message latency, measured between two pipeline stages, not fitted, and
the DP collectives' rates, measured over the ranks."""

from __future__ import annotations

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
from megatron_mllm.runtime.planning.link_probe import (
    activation_shape,
    dp_collective_gbps,
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
    out.append(message_seconds(jobs[0], torch.device("cpu"), torch.bfloat16, 3, pair))
    return [*out, dp_collective_gbps(torch.device("cpu"), 10_000, torch.bfloat16, rounds=2)]


def test_the_latency_is_what_the_model_does_not_already_charge():
    assert message_latency(3e-3, 1e-3) == pytest.approx(2e-3)
    assert message_latency(1e-3, 3e-3) == 0.0


def test_the_pair_and_message_are_a_backbone_activation_between_stages_0_and_1():
    job = _job(ParallelPlan(1, 1, 2))
    assert probe_pair(job) == (0, 1)
    assert activation_shape(job) == (TINY.seq_len, 2, TINY.llm_hidden)
    assert probe_pair(_job(ParallelPlan(1, 2, 1))) is None  # a pipeline of one sends none


def test_every_rank_gets_the_first_stage_measurement_and_the_dp_rates():
    (pp2, dp2, own, rates), (pp2_, dp2_, own_, rates_) = spawn(
        _probe, 2, [_job(ParallelPlan(1, 1, 2)), _job(ParallelPlan(1, 2, 1))]
    )
    assert pp2 == pp2_ and 0 < pp2 < 1.0
    assert dp2 == dp2_ == 0.0
    assert own == own_ and 0 < own < 1.0
    # A bucket's reduce-scatter and all-gather: the slowest rank's rate, the same on every rank.
    assert rates == rates_ and set(rates) == {"reduce_scatter", "all_gather"}
    assert all(0 < v < 1e4 for v in rates.values()), rates


def test_the_dp_collectives_cost_what_the_job_measured():
    """Measured rates replace the profile's network bandwidth for the DP collectives; without
    them the profile's stays."""
    from megatron_mllm.runtime.planning.schedules import CPU
    from megatron_mllm.schedule.cost_model import CostModel

    params, dp = 1e6, 2
    analytic = CostModel(CPU, 1)
    measured = CostModel(CPU, 1, measured={"dp": {"gbps": {"reduce_scatter": 0.5}}})
    assert analytic.dp_reduce_scatter_s(params, dp) == pytest.approx(
        0.5 * params * 4 / (CPU.internode_gbps * 1e9) + CPU.latency_s
    )
    assert measured.dp_reduce_scatter_s(params, dp) == pytest.approx(
        0.5 * params * 4 / 0.5e9 + CPU.latency_s
    )
    assert measured.dp_gather_s(params, dp) == analytic.dp_gather_s(params, dp)  # not measured
    assert measured.dp_reduce_scatter_s(params, 1) == 0.0
