"""A part's gradient reduction over its own DP group, started where the schedule places its RS
action and finished at step end, bucket by bucket, so it overlaps the compute that follows
(e.g. a replicated encoder's all-reduce behind the backbone's last backward work).

With the replicated fp32 optimizer this is a full all-reduce (the distributed optimizer's
reduce-scatter is the bf16 / distributed-optimizer issue). The encoder's DP group holds m
pipelines per backbone replica, each with its own micro-batches: their gradients add up, then
average over the backbone's replicas (`divide_by`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

BUCKET_BYTES = 8 * 2**20  # megatron-core's DDP default bucket size is of this order


def _buckets(params: list[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, about `limit` bytes each."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def start_reduction(
    params: list[torch.nn.Parameter],
    group,
    divide_by: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> Callable[[], None]:
    """Start the all-reduce of every bucket of `params`' gradients (asynchronously); returns the
    function that waits for them and writes the averaged gradients back."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    reduce = dist.get_world_size(group) > 1
    started = []
    for bucket in _buckets(params, bucket_bytes):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        work = dist.all_reduce(flat, group=group, async_op=True) if reduce else None
        started.append((bucket, flat, work))

    def finish() -> None:
        for bucket, flat, work in started:
            if work is not None:
                work.wait()
            flat /= divide_by
            i = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[i : i + n].view_as(p))
                i += n

    return finish
