"""The optimizer's per-parameter state in the model's shape, as our checkpoints store it.

A checkpoint keeps, per parameter, its fp32 value and its Adam moments as full tensors (this
rank's TP piece; see checkpointing.py), whatever optimizer wrote them and whatever the
parameters' own dtype. With megatron-core's
FP32Optimizer the moments already have the parameter's shape. The DistributedOptimizer holds, on
each DP rank, only a contiguous range of every parameter's flattened fp32 main value and moments;
`gather` assembles the full tensors over the part's DP group (one all-reduce per sub-optimizer of
disjoint ranges, so the result is exact) and `scatter` writes a loaded full tensor's ranges back.
So a checkpoint saved with the distributed optimizer loads without it, under another DP size or
another pair of plans, and the reverse, with nothing converted but the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mllm.runtime.assembly.optimizer import sub_optimizers

MOMENTS = ("exp_avg", "exp_avg_sq")


def _is_distributed(sub) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(sub, DistributedOptimizer)


def ensure_adam_state(optimizer) -> None:
    """Create zero Adam moments where the optimizer has not stepped yet (to load into)."""
    for sub in sub_optimizers(optimizer):
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                st = sub.optimizer.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)


def _model_params(sub) -> list[torch.nn.Parameter]:
    """A DistributedOptimizer's model parameters in buffer order (the same on every DP rank)."""
    return [p for buf in sub.buffers for p in buf.params]


def _gather_distributed(sub) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Full main values and moments of a DistributedOptimizer's parameters (collective over its
    DP group)."""
    params = _model_params(sub)
    if not params:
        return {}
    keys = ("main", *MOMENTS)
    total = sum(p.numel() for p in params)
    flat = torch.zeros(len(keys), total, dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        if p in sub.model_param_gbuf_map:
            local = sub._get_model_param_range_map(p)["param"]
            tensors = sub._get_main_param_and_optimizer_states(p)
            for k, key in enumerate(keys):
                src = tensors["param" if key == "main" else key]
                flat[k, offset + local.start : offset + local.end] = src.reshape(-1)
        offset += p.numel()
    dist.all_reduce(flat, group=sub.data_parallel_group)  # disjoint ranges: a sum is a gather
    out, offset = {}, 0
    for p in params:
        view = flat[:, offset : offset + p.numel()]
        out[p] = {key: view[k].view(p.shape) for k, key in enumerate(keys)}
        offset += p.numel()
    return out


def gather(optimizer) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Per model parameter: its moments and (distributed optimizer) fp32 main value, full size
    (the main value is current even where the model's copy awaits an overlapped gather).
    Tensors of the FP32Optimizer are its own state (loading into them loads the optimizer);
    the distributed optimizer's are copies (`scatter` puts them back). Collective; every rank
    takes its sub-optimizers in one order."""
    ensure_adam_state(optimizer)
    out = {}
    for sub in sub_optimizers(optimizer):
        if _is_distributed(sub):
            out.update(_gather_distributed(sub))
            continue
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                st = sub.optimizer.state.get(p, {})
                out[p] = {k: st[k] for k in MOMENTS if k in st}
    return out


def scatter(optimizer, states: dict, iteration: int) -> None:
    """After loading into `gather`'s tensors (and the model's parameters from them): the
    distributed optimizer's ranges, and Adam's step count."""
    step = torch.tensor(float(iteration))
    for sub in sub_optimizers(optimizer):
        if not _is_distributed(sub):
            for st in sub.optimizer.state.values():
                st["step"] = step.clone()
            continue
        for p in _model_params(sub):
            full = states[p]
            value = full["main"]
            if p not in sub.model_param_gbuf_map:
                continue
            local = sub._get_model_param_range_map(p)["param"]
            piece = {"param": value.reshape(-1)[local.start : local.end].float(), "step": step}
            piece.update({k: full[k].reshape(-1)[local.start : local.end] for k in MOMENTS})
            with torch.no_grad():  # the fp32 DO's main values are views of the parameters
                sub._set_main_param_and_optimizer_states(p, piece)
