"""patches/one_rank_collectives_on_cpu.py: megatron-core DDP's bucket all-gather and
reduce-scatter skip gloo on a one-rank group (the identity there) and reach it on larger ones."""

from __future__ import annotations

import torch

from megatron_mllm.runtime.assembly.launch import spawn


def _calls(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from megatron_mllm_patches.one_rank_collectives_on_cpu import _identity_on_one_rank

    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    called = []

    def spy(output, input, group=None, async_op=False, **kwargs):
        called.append(dist.get_world_size(group))
        return dist.reduce_scatter_tensor(output, input, group=group, async_op=async_op, **kwargs)

    rs = _identity_on_one_rank(spy)
    grads = torch.arange(4.0) + 10 * rank
    same = rs(grads, grads, op=dist.ReduceOp.SUM, group=solo, async_op=True)
    out = torch.zeros(4)
    rs(out, grads, group=solo)
    shard = torch.zeros(2)
    rs(shard, torch.arange(4.0) + 10 * rank, group=dist.group.WORLD)
    return {
        "patched": all(
            getattr(getattr(buffers, n), "_megatron_mllm_one_rank_identity", False)
            for n in ("dist_all_gather_func", "dist_reduce_scatter_func")
        ),
        "async_done": same.is_completed() and same.wait(),
        "grads": grads.tolist(),
        "copied": out.tolist(),
        "shard": shard.tolist(),
        "gloo_calls": called,
    }


def test_one_rank_bucket_collectives_skip_gloo_and_larger_groups_reach_it():
    out = spawn(_calls, 2)
    for rank, r in enumerate(out):
        assert r["patched"]  # init_rank applied it to megatron-core's module
        assert r["async_done"]
        assert r["grads"] == [i + 10.0 * rank for i in range(4)]  # in place: unchanged
        assert r["copied"] == r["grads"]  # another output: the input's copy
        assert r["gloo_calls"] == [2]  # only the two-rank group reached gloo
    assert out[0]["shard"] == [10.0, 12.0] and out[1]["shard"] == [14.0, 16.0]
