"""Let megatron-core's mixed-precision / distributed optimizers and their gradient clipping run on
CPU tensors: their tensor-type checks see CUDA type names, the grad norm is computed on the CPU.

TARGET: megatron/core/optimizer/distrib_optimizer.py:582 (DistributedOptimizer.__init__) and
        :361, :420, :431 (_build_model_and_main_param_groups, called from that __init__);
        optimizer/optimizer.py:671, 690, 695 (Float16OptimizerWithFloat16Params.__init__);
        optimizer/clip_grads.py:167 (clip_grad_by_total_norm_fp32 asserts
        'torch.cuda.FloatTensor'); utils.py:1207 (local_multi_tensor_l2_norm, the norm
        clip_grads.py:107 calls without Apex / Transformer Engine, allocates on "cuda").
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: those sites sort parameters and gradients by `tensor.type()` and accept only
'torch.cuda.{Float,Half,BFloat16}Tensor'; on CPU the same tensors say 'torch.FloatTensor' and
are rejected (TypeError) or silently skipped (the 16-bit branch at :582). Within exactly those
calls, a CPU tensor's `type()` (no argument) reports the CUDA name of its dtype; `type(dtype)`
conversions and every other caller are untouched. The fallback l2 norm is replaced by one that
returns its 1-element result on the gradients' device.
Not needed for DDP itself: its CUDA streams (distributed_data_parallel.py:230,
param_and_grad_buffer.py:417/422/529) are only made with num_distributed_optimizer_instances > 1,
and its buffers (param_and_grad_buffer.py:800/806) are placed by `cuda_device_on_cpu`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

TARGET = (
    "DistributedOptimizer.__init__, Float16OptimizerWithFloat16Params.__init__, "
    "clip_grads.clip_grad_by_total_norm_fp32, clip_grads.l2_norm_impl"
)
CHECKED_ON = ("0.16.1",)
_MARK = "_megatron_mllm_cpu_type_names"
_ORIGINAL_TYPE = torch.Tensor.type


def _cuda_name_type(tensor, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and tensor.device.type == "cpu":
        name = _ORIGINAL_TYPE(tensor)  # under a TorchFunctionMode this comes back through us
        return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch.") :]
    if dtype is None and not kwargs:
        return _ORIGINAL_TYPE(tensor)
    return _ORIGINAL_TYPE(tensor, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_type_names():
    """Within the block, `cpu_tensor.type()` answers 'torch.cuda.<Dtype>Tensor'."""
    if "type" in torch.Tensor.__dict__:  # nested: already reporting CUDA names
        yield
        return
    torch.Tensor.type = _cuda_name_type
    try:
        yield
    finally:
        del torch.Tensor.type


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The l2 norm of all tensors in `tensor_lists[0]` as a float32 [1] tensor on their device
    (megatron-core's fallback's contract: (norm, None))."""
    tensors = tensor_lists[0]
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return torch.linalg.vector_norm(norms).reshape(1), None


def apply() -> None:
    if torch.cuda.is_available():
        return
    from megatron.core import utils as mc_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for cls in (
        distrib_optimizer.DistributedOptimizer,
        optimizer.Float16OptimizerWithFloat16Params,
    ):
        if not getattr(cls.__init__, _MARK, False):
            cls.__init__ = _with_cuda_type_names(cls.__init__)
    clip = clip_grads.clip_grad_by_total_norm_fp32
    if not getattr(clip, _MARK, False):
        clip = _with_cuda_type_names(clip)
        clip_grads.clip_grad_by_total_norm_fp32 = clip
        optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there
    if clip_grads.l2_norm_impl is mc_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm_on_device
