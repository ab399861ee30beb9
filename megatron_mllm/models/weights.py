"""One set of weights for every parallel layout: canonical (unsharded) names, sharding a full
state onto a stage, and the inverse for gradients.

Canonical names: `encoder.pos_embed`, `encoder.patch_embed.*`, `encoder.layers.{i}.*` (global
layer index), `encoder.final_layernorm.*`, `projector.*` (encoder e > 0: `encoder{e}.*`,
`projector{e}.*`), `backbone.embedding.*`,
`backbone.decoder.layers.{i}.*`, `backbone.decoder.final_layernorm.*`, `backbone.output_layer.*`.
A tensor-parallel shard differs from the full tensor in one dimension, split into TP contiguous
chunks (megatron-core's column-, row- and vocab-parallel layouts all are), except a SwiGLU
`linear_fc1`, whose TP rank r holds [gate_r; up_r]: viewed as [2, n/2, ...] ("gated") it is
split along dimension 1.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

_LAYER = re.compile(r"^(block\.layers|gpt\.decoder\.layers)\.(\d+)\.(.*)$")
_GATED = re.compile(r"\.mlp\.linear_fc1\.(weight|bias)$")


def gated_names(module: nn.Module) -> set[str]:
    """Canonical names of this module's SwiGLU fc1 tensors (see the module docstring)."""
    config = getattr(getattr(module, "gpt", None), "config", None) or getattr(
        getattr(module, "block", None), "config", None
    )
    if config is None or not config.gated_linear_unit:
        return set()
    return {c for c in canonical_names(module).values() if _GATED.search(c)}


def gated_view(t: torch.Tensor) -> torch.Tensor:
    """[2n, ...] -> [2, n, ...]: the gate and up halves of a SwiGLU fc1 tensor."""
    return t.reshape(2, t.shape[0] // 2, *t.shape[1:])


def shard(full: torch.Tensor, local_shape: torch.Size, tp_rank: int, tp: int, gated: bool):
    """TP rank `tp_rank`'s piece of a canonical tensor."""
    if gated and tp > 1:
        return gated_view(full).chunk(tp, dim=1)[tp_rank].reshape(local_shape)
    dim = split_dim(full.shape, local_shape, tp)
    return full if dim is None else full.chunk(tp, dim=dim)[tp_rank]


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Local parameter name -> canonical name, for an EncoderStage or BackboneStage."""
    from megatron_mllm.models.stages import BackboneStage

    backbone = isinstance(module, BackboneStage)
    layers = module.gpt.decoder.layers if backbone else module.block.layers
    index = 0 if backbone else module.index
    suffix = str(index) if index else ""  # encoder 0: "encoder.", encoder 1: "encoder1.", ...
    out = {}
    for name, _ in module.named_parameters():
        m = _LAYER.match(name)
        if m:
            layer = layers[int(m[2])].layer_number - 1  # megatron-core numbers layers globally
            prefix = "backbone.decoder.layers" if backbone else f"encoder{suffix}.layers"
            out[name] = f"{prefix}.{layer}.{m[3]}"
        elif backbone:
            out[name] = "backbone." + name.removeprefix("gpt.")
        elif name.startswith("projector."):
            out[name] = f"projector{suffix}." + name.removeprefix("projector.")
        else:
            out[name] = f"encoder{suffix}." + name.removeprefix("block.")
    return out


def split_dim(full: torch.Size, local: torch.Size, tp: int) -> int | None:
    """The dimension a TP shard was cut along (None: replicated)."""
    if tuple(full) == tuple(local):
        return None
    dims = [d for d in range(len(full)) if full[d] != local[d]]
    if len(dims) != 1 or full[dims[0]] != local[dims[0]] * tp:
        raise ValueError(f"cannot map shard {tuple(local)} onto {tuple(full)} with TP {tp}")
    return dims[0]


def save_full_state(state: dict[str, torch.Tensor], path: str) -> str:
    """Write canonical weights for `open_full_state` (each rank then maps, not copies, them)."""
    torch.save(state, path)
    return path


INIT_STD = 0.02  # megatron-core's init_method_std default
_OUTPUT_LAYERS = re.compile(r"\.(linear_proj|linear_fc2)\.weight$")  # scaled by 1/sqrt(2 L)


class SeededState(Mapping):
    """Canonical initial weights, each tensor drawn when asked for from a generator seeded by
    the run's seed and the tensor's name: every parallel layout gets the same weights, and a
    rank makes only the tensors its part loads (one full tensor at a time, then sharded).

    Megatron-core's initialisation, by name: norm weights 1, biases 0, weights normal(0,
    0.02), attention and MLP output projections scaled by 1/sqrt(2 x the model's layers), the
    patch embedding (a torch Linear) uniform within 1/sqrt(fan-in). `layers`: name prefix ->
    layer count; `made`: names drawn so far (each draw counted)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, layers: dict[str, int]):
        self.shapes, self.seed, self.layers = dict(shapes), seed, dict(layers)
        self.made: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]  # KeyError for a name the model does not have
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))
        self.made.append(name)
        return _initial(name, shape, gen, self._layers_of(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def _layers_of(self, name: str) -> int:
        prefix = max((p for p in self.layers if name.startswith(p)), key=len, default=None)
        return self.layers.get(prefix, 1)

    def made_bytes(self) -> int:
        """Bytes of fp32 tensors drawn so far."""
        return sum(4 * math.prod(self.shapes[n]) for n in self.made)


def shapes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Each canonical tensor's shape, without drawing a SeededState's tensors."""
    if isinstance(state, SeededState):
        return dict(state.shapes)
    return {k: tuple(v.shape) for k, v in state.items()}


def _initial(name: str, shape: tuple[int, ...], gen: torch.Generator, layers: int):
    if "patch_embed" in name:
        bound = 1 / math.sqrt(shape[-1] if len(shape) > 1 else shape[0])
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    if len(shape) == 1 and name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape)
    std = INIT_STD / math.sqrt(2 * layers) if _OUTPUT_LAYERS.search(name) else INIT_STD
    return torch.randn(shape, generator=gen) * std


def open_full_state(source: Mapping[str, torch.Tensor] | str) -> Mapping[str, torch.Tensor]:
    """Canonical weights from a mapping (a dict, a SeededState) or a file written by
    `save_full_state`. A file is memory-mapped: a rank reads only the pages of its own shards
    when it loads them."""
    if isinstance(source, Mapping):
        return source
    return torch.load(source, mmap=True, weights_only=True)


@torch.no_grad()
def load_full_state(
    module: nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp: int
) -> None:
    """Copy this module's shard of every canonical tensor into its parameters."""
    names, gated = canonical_names(module), gated_names(module)
    for name, param in module.named_parameters():
        c = names[name]
        param.copy_(shard(full[c], param.shape, tp_rank, tp, c in gated))


def full_state(*modules: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical state of unsharded (TP = PP = 1) modules."""
    out = {}
    for module in modules:
        names = canonical_names(module)
        for name, param in module.named_parameters():
            out[names[name]] = param.detach().clone()
    return out


def grad_shards(module: nn.Module, tp_rank: int) -> dict[str, tuple[torch.Tensor, int, bool]]:
    """canonical name -> (local gradient, TP rank, gated) for reassembly by `assemble_grads`."""
    names, gated = canonical_names(module), gated_names(module)
    return {
        names[n]: (
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", copy=True),
            tp_rank,
            names[n] in gated,
        )
        for n, p in module.named_parameters()
    }


def param_shards(module: nn.Module, tp_rank: int) -> dict[str, tuple[torch.Tensor, int, bool]]:
    """Like `grad_shards`, for the parameter values (reassembled by `assemble_grads` too)."""
    names, gated = canonical_names(module), gated_names(module)
    return {
        names[n]: (p.detach().to("cpu", copy=True), tp_rank, names[n] in gated)
        for n, p in module.named_parameters()
    }


def assemble_grads(
    shards: list[dict[str, tuple[torch.Tensor, int, bool]]],
    full_shapes: dict[str, torch.Size],
    tp: dict[str, int],
) -> dict[str, torch.Tensor]:
    """Full gradients from every rank's shards; `tp[name]` is the TP size it was cut with."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    gated: set[str] = set()
    for rank_shards in shards:
        for name, (grad, tp_rank, is_gated) in rank_shards.items():
            pieces.setdefault(name, {})[tp_rank] = grad
            if is_gated:
                gated.add(name)
    out = {}
    for name, by_rank in pieces.items():
        ordered = [by_rank[r] for r in sorted(by_rank)]
        if name in gated and tp[name] > 1:
            out[name] = torch.cat([gated_view(g) for g in ordered], 1).reshape(full_shapes[name])
            continue
        dim = split_dim(full_shapes[name], ordered[0].shape, tp[name])
        out[name] = ordered[0] if dim is None else torch.cat(ordered, dim)
    return out
