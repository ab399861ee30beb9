"""The optimizers: megatron-core's FP32Optimizer over one rank's parameters with our clipping by
the norm of the whole model (backbone and encoder shards each summed over their own
model-parallel group, so replicas are counted once), or megatron-core's DistributedOptimizer
over the DDP-wrapped parts with its own clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def sub_optimizers(optimizer) -> list:
    """A megatron-core optimizer's parts (a ChainedOptimizer's, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _adam_config(
    lr: float,
    weight_decay: float = 0.0,
    clip_grad: float = 0.0,
    dtype: torch.dtype = torch.float32,
    min_lr: float = 0.0,
    distributed: bool = False,
    overlap_param_gather: bool = False,
    initial_loss_scale: float = 2.0**32,
):
    """megatron-core's OptimizerConfig for Adam in `dtype` (bf16 and fp16: fp32 main
    parameters; fp16: a dynamic loss scale starting at `initial_loss_scale`)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,  # megatron-core's dynamic loss scaler
        initial_loss_scale=initial_loss_scale,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
        overlap_param_gather=overlap_param_gather,
    )


def build_optimizer(modules: list[torch.nn.Module], lr: float, weight_decay: float = 0.0):
    """megatron-core's FP32Optimizer (AdamW) over these modules' trainable parameters; clipping
    is ours (`clip_by_global_norm`)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    params = [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]
    config = _adam_config(lr, weight_decay)
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return FP32Optimizer(inner, config, init_state_fn=None)


def allreduce_sequence_parallel_grads(modules: list[torch.nn.Module | None], tp_group) -> None:
    """Sum, over the TP group, the gradients of parameters that sequence parallelism leaves
    replicated but feeds different tokens on each TP rank (norms; megatron-core marks them
    `sequence_parallel`). What megatron-core's finalize_model_grads does for them."""
    grads = [  # megatron-core's DDP keeps them in main_grad (under the distributed optimizer
        # only this rank's shard is reduced there; the TP sum is linear, so the shard is right)
        getattr(p, "main_grad", p.grad)
        for m in modules
        if m is not None
        for p in m.parameters()
        if getattr(p, "sequence_parallel", False) and getattr(p, "main_grad", p.grad) is not None
    ]
    if not grads or dist.get_world_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    i = 0
    for g in grads:
        g.copy_(flat[i : i + g.numel()].view_as(g))
        i += g.numel()


def clip_by_global_norm(
    parts: list[tuple[torch.nn.Module | None, object, object]],
    max_norm: float,
    device: torch.device | str = "cpu",
) -> float:
    """Scale every gradient so the whole model's norm is at most `max_norm`; return the norm.

    `parts` are (module, model-parallel group, TP group): the first group's shards together make
    the model part once; a parameter not split by TP counts on TP rank 0 only (megatron-core's
    rule). Modules may be None on ranks without them (they add nothing). The sums live on
    `device`, the gradients' device (an NCCL group reduces CUDA tensors only).
    """
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for module, group, tp_group in parts:
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        if module is not None:
            tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
            for p in module.parameters():
                duplicate = not getattr(p, "tensor_model_parallel", False) and tp_rank > 0
                if p.grad is not None and not duplicate:
                    sq += p.grad.double().pow(2).sum()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total += sq
    norm = float(total.sqrt())  # the step's one read of the norm
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = [
            p.grad
            for m, _, _ in parts
            if m is not None
            for p in m.parameters()
            if p.grad is not None
        ]
        torch._foreach_mul_(grads, scale)
    return norm


def step_megatron_optimizer(optimizer, skip_nonfinite: bool = True) -> tuple[bool, float]:
    """One step of a megatron-core (chained) optimizer that is skipped, not applied, when the
    whole model's gradient norm is NaN or Inf (`skip_nonfinite`): (applied, norm).
    ChainedOptimizer.step's order (prepare the main grads, the norm, clipping by it, the update
    and parameter all-gather)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    scaler = optimizer.chained_optimizers[0].grad_scaler if optimizer.chained_optimizers else None
    overflow = _prepare_fp16(optimizer, scaler) if scaler else optimizer.prepare_grads()
    if overflow:  # an fp16 overflow: the loss scale backs off, the step is skipped
        return False, float("nan")
    norm = float(optimizer.get_grad_norm())
    if skip_nonfinite and not math.isfinite(norm):
        return False, norm
    for sub in optimizer.chained_optimizers:
        params = sub.get_parameters()
        if sub.config.clip_grad > 0 and params:
            clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=norm)
    return bool(optimizer.step_with_ready_grads()), norm


def grad_scaler_state(scaler) -> dict:
    """A dynamic loss scaler's state for a checkpoint (tensors on the CPU)."""
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in scaler.state_dict().items()}


def load_grad_scaler_state(scaler, state: dict) -> None:
    """What megatron-core's DynamicGradScaler.load_state_dict sets, on the scaler's own device
    (upstream moves the scale with `.cuda()`, which a CPU rank cannot)."""
    scaler._scale = state["scale"].to(scaler.scale.device)
    scaler._growth_tracker = state["growth_tracker"]
    scaler._hysteresis_tracker = state["hysteresis_tracker"]


def _prepare_fp16(optimizer, scaler) -> bool:
    """fp16: every sub-optimizer's main gradients unscaled by the one shared loss scale, one
    overflow check over the whole world (every rank, whatever parts it holds, runs it once) and
    one update of the scale (megatron-core's MixedPrecisionOptimizer.prepare_grads, per
    sub-optimizer, would update a shared scaler once per part and check per part)."""
    found = torch.zeros(1, dtype=torch.float32, device=scaler.scale.device)
    for sub in optimizer.chained_optimizers:
        sub._copy_model_grads_to_main_grads()
        grads = sub._collect_main_grad_data_for_unscaling()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scaler.inv_scale)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    overflow = bool(found.item() > 0)
    scaler.update(overflow)
    return overflow


def build_distributed_optimizer(
    parts: dict,
    names: list[str],
    lr: float,
    clip_grad: float,
    dtype: torch.dtype = torch.float32,
    weight_decay: float = 0.0,
    min_lr: float = 0.0,
    overlap_param_gather: bool = False,
    initial_loss_scale: float = 2.0**32,
):
    """megatron-core's DistributedOptimizer (Adam) over DDP-wrapped parts (data_parallel's
    PartGradSync by name), one per part's DP group, chained: the optimizer state is sharded over
    each part's DP group, gradients are clipped by the whole model's norm (summed over the world,
    as every part spans it) and the parameters all-gathered at the end of each step (with
    `overlap_param_gather` by the next step's AG actions instead). With bf16 parameters it keeps
    fp32 main parameters (megatron-core's mixed precision). `names`: every part of the job in
    one order, also those this rank does not hold (see `_join_param_group_alignment`)."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    config = _adam_config(
        lr, weight_decay, clip_grad, dtype, min_lr, True, overlap_param_gather, initial_loss_scale
    )
    chained = []
    for name in names:
        part = parts.get(name)
        if part is None:
            _join_param_group_alignment()
            continue
        built = get_megatron_optimizer(
            config, part.ddps, use_gloo_process_groups=False, pg_collection=part.pg
        )
        chained += built.chained_optimizers
    for sub in chained[1:]:  # fp16: one loss scale for the whole model (see `_prepare_fp16`)
        sub.grad_scaler = chained[0].grad_scaler
    return ChainedOptimizer(chained)


# get_megatron_optimizer aligns its param-group keys over the whole world: one
# all_gather_object for the dense and one for the expert param groups (megatron-core 0.16.1,
# optimizer/__init__.py:181, reached from :257 and :647). Checked on these versions only.
_ALIGNMENT_GATHERS = {"0.16.1": 2}


def _join_param_group_alignment() -> None:
    """Those world-wide collectives for a part this rank does not hold (the encoder on stage 0
    only, or a frozen encoder's stages before its projector), so every rank runs them as
    often; contributes no keys."""
    import megatron.core

    count = _ALIGNMENT_GATHERS.get(megatron.core.__version__)
    if count is None:
        raise RuntimeError(
            f"megatron-core {megatron.core.__version__}: how many collectives "
            "get_megatron_optimizer runs is checked for 0.16.1 only"
        )
    for _ in range(count):
        dist.all_gather_object([None] * dist.get_world_size(), [])
