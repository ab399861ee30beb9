"""Skip megatron-core DDP's gradient reduce-scatter and parameter all-gather on a one-rank group
when gloo would run them, where they are the identity.

TARGET: megatron/core/distributed/param_and_grad_buffer.py:35-36 `dist_all_gather_func` /
        `dist_reduce_scatter_func`, called by `_ParamAndGradBucketGroup.start_param_sync` (:285,
        the distributed optimizer's parameter all-gather) and `.start_grad_sync` (:443, its
        gradient reduce-scatter), once per bucket per step.
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build, gloo).
WHY: with data-parallel size 1 (a pipeline of 2 ranks, for example) every bucket still goes
through a collective on a group of one rank, whose result is its input: the reduce-scatter's
output is the bucket's only shard (the same memory as its input), the all-gather's input the
buffer's only shard. NCCL runs such a call as an asynchronous kernel on its own stream; gloo runs
it on the calling thread, 5.3 ms for a 2M-parameter fp32 gradient bucket (0.8 ms for its bf16
parameters) on this 2-core machine, where a copy of it takes 0.6 ms. At the benchmark's medium
size that is ~150 ms of host time a step, spent inside the last micro-batch's backward (where
the buckets become ready), and it varied 50-300 ms from step to step. On a one-rank group the
call now returns at once (a copy when the two tensors are not the same memory; a completed work
where an asynchronous one was asked for); groups of two or more ranks go to gloo as before.
Applied on CPU only (`apply_cpu_patches`); the CUDA path is untouched.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

TARGET = (
    "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func, "
    ".dist_reduce_scatter_func"
)
CHECKED_ON = ("0.16.1",)
_MARK = "_megatron_mllm_one_rank_identity"
_ONE_RANK_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def _completed() -> dist.Work:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _identity_on_one_rank(collective):
    """`collective(output, input, group=..., async_op=..., [op=...])` that, on a one-rank gloo
    group, makes `output` equal `input` itself instead of calling gloo."""

    @functools.wraps(collective)
    def wrapper(output, input, *args, group=None, async_op=False, **kwargs):
        op = kwargs.get("op", dist.ReduceOp.SUM)
        one_rank = dist.get_world_size(group) == 1 and dist.get_backend(group) == "gloo"
        if args or not one_rank or op not in _ONE_RANK_OPS or output.numel() != input.numel():
            return collective(output, input, *args, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return _completed() if async_op else None

    setattr(wrapper, _MARK, True)
    return wrapper


def apply() -> None:
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        current = getattr(buffers, name)
        if not getattr(current, _MARK, False):
            setattr(buffers, name, _identity_on_one_rank(current))
