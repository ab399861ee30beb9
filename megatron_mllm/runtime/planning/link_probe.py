"""What one pipeline message and one DP bucket's collectives really cost in the running job,
measured, for the cost model.

The plan candidates used to fit one latency per message so that the warm-up plan's simulated
step equalled its measured one. That number absorbed whatever else the warm-up steps held
(they still run slower than the steps after them) and charged it to every message, so a plan
that sends more messages was predicted too slow. Here the first pipeline's stages 0 and 1
exchange a backbone activation (its shape and dtype) a few times while nothing else runs, and
the one-way time beyond the cost model's own figure for that tensor is the latency the
calibrated workload adds to every message.

The DP collectives were priced at the profile's network bandwidth (2 GB/s on the CPU profile);
over gloo on this machine one bucket's reduce-scatter and all-gather run 2-9x slower than that,
so a plan that replicates the encoder was predicted far too fast. `dp_collective_gbps` times one
bucket of each, as megatron-core's DDP and distributed optimizer send them, on the whole world.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from megatron_mllm.parallel.groups import backbone_rank
from megatron_mllm.runtime.engine.clock import StepClock, median_seconds


def probe_pair(job) -> tuple[int, int] | None:
    """The two ranks a backbone activation travels between (the first pipeline's stages 0 and
    1); None in a pipeline of one, where no backbone message is sent."""
    plan = job.backbone
    if plan.pp < 2:
        return None
    return backbone_rank(plan, 0, 0, 0), backbone_rank(plan, 0, 0, 1)


def activation_shape(job) -> tuple[int, int, int]:
    """A backbone activation message's shape ([s/tp, b, h] with sequence parallelism)."""
    split = job.backbone.tp if job.plans.sequence_parallel else 1
    return (job.cfg.seq_len // split, job.micro_batch, job.cfg.llm_hidden)


def message_seconds(
    job, device: torch.device, dtype: torch.dtype, rounds: int = 5, groups: dict | None = None
) -> float:
    """The median one-way time of a backbone activation between the probe pair's ranks, half a
    round trip (collective: every rank calls it; the result is every rank's); 0.0 where no
    backbone message is sent. `groups`: the run's message groups by (src, dst) (ordered
    messages, as on NCCL): the pair's own carries the probe, so no other communicator is made."""
    pair = probe_pair(job)
    seconds = torch.zeros(1, dtype=torch.float64, device=device)
    if pair is not None and dist.get_rank() in pair:
        me, peer = (0, pair[1]) if dist.get_rank() == pair[0] else (1, pair[0])
        buf = torch.zeros(activation_shape(job), dtype=dtype, device=device)
        clock, marks = StepClock(device), []
        for _ in range(rounds + 1):  # the first round sets the pair's connection up
            marks.append(clock.mark())
            _round_trip(buf, peer, me == 0, (groups or {}).get(pair))
        marks.append(clock.mark())
        clock.finish()
        times = [clock.between(a, b) / 2 for a, b in zip(marks[1:-1], marks[2:], strict=True)]
        seconds[0] = statistics.median(times) if me == 0 else 0.0
    dist.all_reduce(seconds)  # only the first stage's figure is non-zero
    return float(seconds.item())


def _round_trip(buf: torch.Tensor, peer: int, first: bool, group=None) -> None:
    if first:
        dist.send(buf, peer, group=group)
        dist.recv(buf, peer, group=group)
    else:
        dist.recv(buf, peer, group=group)
        dist.send(buf, peer, group=group)


def message_latency(measured_one_way_s: float, modelled_act_s: float) -> float:
    """The latency to add to every modelled message: the measured activation's one-way time
    beyond what the cost model already charges for it (never below 0)."""
    return max(measured_one_way_s - modelled_act_s, 0.0)


DEFAULT_BUCKET_PARAMS = 40_000_000  # megatron-core DDP's bucket size at small DP (0.16.1)
PROBE_PARAMS_MAX = 8_000_000  # a larger bucket is probed at this size (its rate is the same)


def dp_collective_gbps(
    device: torch.device,
    bucket_params: int | None,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype = torch.float32,
    rounds: int = 3,
) -> dict[str, float]:
    """The effective bandwidth of the distributed optimizer's collectives over the world, in
    the cost model's terms ((g - 1) / g of the bytes over the seconds, GB/s): a DDP bucket's
    gradients reduce-scattered in `grad_dtype` and its parameters all-gathered in `param_dtype`,
    the median of `rounds` after one warm-up, the slowest rank's (every rank calls it and gets
    the same figures); {} in a world of one."""
    world = dist.get_world_size()
    if world < 2:
        return {}
    count = min(bucket_params or DEFAULT_BUCKET_PARAMS, PROBE_PARAMS_MAX) // world * world
    grads = torch.ones(count, dtype=grad_dtype, device=device)
    params = torch.zeros(count, dtype=param_dtype, device=device)
    shard_g = torch.empty(count // world, dtype=grad_dtype, device=device)
    shard_p = params[: count // world].clone()
    calls = (
        lambda: dist.reduce_scatter_tensor(shard_g, grads),
        lambda: dist.all_gather_into_tensor(params, shard_p),
    )
    times = [median_seconds(call, rounds, device, before=dist.barrier) for call in calls]
    seconds = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    share = (world - 1) / world
    rs_s, ag_s = seconds.tolist()
    return {
        "reduce_scatter": share * count * grads.element_size() / (rs_s * 1e9),
        "all_gather": share * count * params.element_size() / (ag_s * 1e9),
    }
