"""One set of weights for every parallel layout: canonical (unsharded) names, sharding a full
state onto a stage, and the inverse for gradients.

Canonical names: `encoder.pos_embed`, `encoder.patch_embed.*`, `encoder.layers.{i}.*` (global
layer index), `encoder.final_layernorm.*`, `projector.*`, `backbone.embedding.*`,
`backbone.decoder.layers.{i}.*`, `backbone.decoder.final_layernorm.*`, `backbone.output_layer.*`.
A tensor-parallel shard differs from the full tensor in one dimension, split into TP contiguous
chunks (megatron-core's column-, row- and vocab-parallel layouts all are).
"""

from __future__ import annotations

import re

import torch
from torch import nn

_LAYER = re.compile(r"^(block\.layers|gpt\.decoder\.layers)\.(\d+)\.(.*)$")


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Local parameter name -> canonical name, for an EncoderStage or BackboneStage."""
    from megatron_mllm.models.stages import BackboneStage

    backbone = isinstance(module, BackboneStage)
    layers = module.gpt.decoder.layers if backbone else module.block.layers
    out = {}
    for name, _ in module.named_parameters():
        m = _LAYER.match(name)
        if m:
            layer = layers[int(m[2])].layer_number - 1  # megatron-core numbers layers globally
            prefix = "backbone.decoder.layers" if backbone else "encoder.layers"
            out[name] = f"{prefix}.{layer}.{m[3]}"
        elif backbone:
            out[name] = "backbone." + name.removeprefix("gpt.")
        elif name.startswith("projector."):
            out[name] = name
        else:
            out[name] = "encoder." + name.removeprefix("block.")
    return out


def split_dim(full: torch.Size, local: torch.Size, tp: int) -> int | None:
    """The dimension a TP shard was cut along (None: replicated)."""
    if tuple(full) == tuple(local):
        return None
    dims = [d for d in range(len(full)) if full[d] != local[d]]
    if len(dims) != 1 or full[dims[0]] != local[dims[0]] * tp:
        raise ValueError(f"cannot map shard {tuple(local)} onto {tuple(full)} with TP {tp}")
    return dims[0]


@torch.no_grad()
def load_full_state(
    module: nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp: int
) -> None:
    """Copy this module's shard of every canonical tensor into its parameters."""
    names = canonical_names(module)
    for name, param in module.named_parameters():
        tensor = full[names[name]]
        dim = split_dim(tensor.shape, param.shape, tp)
        if dim is not None:
            tensor = tensor.chunk(tp, dim=dim)[tp_rank]
        param.copy_(tensor)


def full_state(*modules: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical state of unsharded (TP = PP = 1) modules."""
    out = {}
    for module in modules:
        names = canonical_names(module)
        for name, param in module.named_parameters():
            out[names[name]] = param.detach().clone()
    return out


def grad_shards(module: nn.Module, tp_rank: int) -> dict[str, tuple[torch.Tensor, int]]:
    """canonical name -> (local gradient, TP rank) for reassembly by `assemble_grads`."""
    names = canonical_names(module)
    return {
        names[n]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p), tp_rank)
        for n, p in module.named_parameters()
    }


def assemble_grads(
    shards: list[dict[str, tuple[torch.Tensor, int]]],
    full_shapes: dict[str, torch.Size],
    tp: dict[str, int],
) -> dict[str, torch.Tensor]:
    """Full gradients from every rank's shards; `tp[name]` is the TP size it was cut with."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for rank_shards in shards:
        for name, (grad, tp_rank) in rank_shards.items():
            pieces.setdefault(name, {})[tp_rank] = grad
    out = {}
    for name, by_rank in pieces.items():
        first = by_rank[min(by_rank)]
        dim = split_dim(full_shapes[name], first.shape, tp[name])
        out[name] = first if dim is None else torch.cat([by_rank[r] for r in sorted(by_rank)], dim)
    return out
