"""Measured per-kernel times of one transformer layer at a TP shard's shapes, for the cost
model (`plan_schedule.py --measured-times`).

One GPU of a TP group runs 1/tp of the heads and of the MLP width; a one-rank megatron-core
layer with `num_attention_heads = a/tp`, head size h/a and `ffn_hidden_size = f/tp` has exactly
those GEMM, attention and norm shapes (the TP collectives are not in it; the cost model adds
them). Each of the eight kernels (ln1, qkv, attn, proj, ln2, fc1, act, fc2: the executor's
kernel units) is timed on its own, forward and backward, as the median of `repeats` runs, with
StepClock (CUDA events on a GPU). The attention runs without a mask (megatron-core's local,
unfused attention costs the same with the causal one).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_mllm.runtime.engine.clock import cache_flusher, median_seconds
from megatron_mllm.schedule.cost_model import FORWARD_KERNELS
from megatron_mllm.schedule.specs import TransformerSpec


def shard_layer(spec: TransformerSpec, tp: int, dtype: torch.dtype, device, pg):
    """A one-rank megatron-core TransformerLayer with the shapes one GPU of a TP group runs."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_mllm.models.config import TINY, transformer_config
    from megatron_mllm.models.stages import _vit_layer_spec

    h, a, f = spec.hidden_size, spec.num_heads, spec.ffn_hidden_size
    if a % tp or f % tp:
        raise ValueError(f"{spec.name}: {a} heads and MLP width {f} do not split over TP {tp}")
    cfg = replace(TINY, vit_layers=1, vit_hidden=h, vit_heads=a // tp, vit_ffn=f // tp)
    precision = {} if dtype == torch.float32 else {"params_dtype": dtype, "pipeline_dtype": dtype}
    if dtype == torch.bfloat16:
        precision["bf16"] = True
    elif dtype == torch.float16:
        precision["fp16"] = True
    config = transformer_config(cfg, "vit", 1, 1, kv_channels=h // a, **precision)
    block = TransformerBlock(config, _vit_layer_spec(), pre_process=True, post_process=False,
                             pg_collection=pg)  # fmt: skip
    return block.layers[0].to(device, dtype)


def kernel_times(
    spec: TransformerSpec,
    tp: int,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    pg=None,
) -> dict[str, dict[str, float]]:
    """{"forward": {kernel: s}, "backward": {kernel_b: s}} for one layer of `spec` on one GPU
    of a TP-`tp` group (micro-batch `micro_batch`, `seq_len` tokens)."""
    from megatron_mllm.models.units import layer_kernels
    from megatron_mllm.runtime.assembly.model_builder import solo_groups

    layer = shard_layer(spec, tp, dtype, device, pg if pg is not None else solo_groups())
    kernels = layer_kernels(layer)
    state = (torch.randn(seq_len, micro_batch, spec.hidden_size, device=device, dtype=dtype),)
    out = {"forward": {}, "backward": {}}
    flush = cache_flusher(device)  # each kernel timed with a cold L2, as a step runs it
    for name, kernel in zip(FORWARD_KERNELS, kernels, strict=True):
        leaves = tuple(t.detach().requires_grad_() for t in state)
        with torch.no_grad():
            out["forward"][name] = median_seconds(
                lambda k=kernel, x=leaves: k(x), repeats, device, before=flush
            )

        def backward(k=kernel, x=leaves):
            ys = [y for y in k(x) if y.requires_grad]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])

        total = median_seconds(backward, repeats, device, before=flush)
        out["backward"][name + "_b"] = max(total - out["forward"][name], 0.0)
        with torch.no_grad():
            state = kernel(leaves)
    return out
