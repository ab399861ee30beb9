"""Qwen2-VL's native-resolution vision tower from megatron-core parts, and its Hugging Face
weights.

Each image keeps its own size: its pixels are cut into patches of `patch_size` (two frames deep,
`temporal_patch_size`, as Qwen2-VL's processor repeats a still image), ordered so that every
`merge x merge` window of neighbouring patches is contiguous; the images of a micro-batch are
concatenated into one sequence of patches. The layers are megatron-core's TransformerLayers
(LayerNorm, biases, QuickGELU MLP) with 2-D rotary positions (each patch's row and column, on
the head's two halves) and attention only within an image (a block-diagonal mask); the patch
merger (LayerNorm, then an MLP over each window's patches side by side) gives one backbone token
per window. Shapes follow megatron-core: [patches, 1, hidden].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Qwen2VisionSpec:
    """The vision tower's shape (Hugging Face's `Qwen2VLVisionConfig` names in comments)."""

    layers: int = 32  # depth
    hidden: int = 1280  # embed_dim
    heads: int = 16  # num_heads
    mlp_ratio: float = 4.0
    out_hidden: int = 3584  # hidden_size: the backbone's
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge: int = 2  # spatial_merge_size
    channels: int = 3  # in_channels
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size**2


def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2] each patch's (row, column) in its image, in the merge-window order the
    patches come in (every frame of an image repeats them)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def block_diagonal_mask(grid_thw: torch.Tensor, device) -> torch.Tensor:
    """megatron-core's boolean mask [1, 1, n, n] (True: not allowed): each frame of each image
    attends only to itself."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    return (owner[:, None] != owner[None, :])[None, None]


class Qwen2VisionTower(nn.Module):
    """The vision tower on TP group `pg.tp` of `tp` (megatron-core's layers shard over it; the
    patch embedding and the merger are whole on every rank)."""

    def __init__(self, spec: Qwen2VisionSpec, pg, tp: int = 1) -> None:
        super().__init__()
        from megatron.core.activations import quick_gelu
        from megatron.core.models.vision import vit_layer_specs
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.spec = spec
        config = TransformerConfig(
            num_layers=spec.layers,
            hidden_size=spec.hidden,
            num_attention_heads=spec.heads,
            ffn_hidden_size=int(spec.hidden * spec.mlp_ratio),
            tensor_model_parallel_size=tp,
            pipeline_dtype=torch.float32,
            params_dtype=torch.float32,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            layernorm_epsilon=1e-6,
            activation_func=quick_gelu,
        )
        layer = copy.deepcopy(vit_layer_specs.get_vit_layer_with_local_spec())
        layer.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
        self.patch_embed = nn.Linear(spec.patch_dim, spec.hidden, bias=False)
        self.block = TransformerBlock(
            config, layer, post_layer_norm=False, pre_process=True, post_process=False,
            pg_collection=pg,
        )  # fmt: skip
        window = spec.hidden * spec.merge**2
        self.merger_norm = nn.LayerNorm(spec.hidden, eps=1e-6)
        self.merger_fc1 = nn.Linear(window, window)
        self.merger_fc2 = nn.Linear(window, spec.out_hidden)
        dim = spec.hidden // spec.heads // 2  # each of row and column rotates half the head
        self.register_buffer(
            "inv_freq",
            1.0 / spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim),
            persistent=False,
        )

    def rotary(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """megatron-core's rotary angles [patches, 1, 1, head dim]: rows on the first quarter,
        columns on the second, repeated for the rotate-half pairs."""
        pos = vision_position_ids(grid_thw, self.spec.merge).to(self.inv_freq.device)
        angles = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, rows | columns]
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, patch_dim] (every image's, concatenated) -> [windows, out_hidden]."""
        x = self.patch_embed(patches).unsqueeze(1)  # [n, 1, hidden]
        mask = block_diagonal_mask(grid_thw, x.device)
        x = self.block(hidden_states=x, attention_mask=mask, rotary_pos_emb=self.rotary(grid_thw))
        window = self.spec.hidden * self.spec.merge**2
        x = self.merger_norm(x.squeeze(1)).reshape(-1, window)
        return self.merger_fc2(nn.functional.gelu(self.merger_fc1(x)))


def qwen2_vision_from_hf(sd: dict, spec: Qwen2VisionSpec) -> dict[str, torch.Tensor]:
    """Hugging Face's `model.visual.*` weights -> `Qwen2VisionTower`'s state dict."""
    from megatron_mllm.models.hf_llava import _fuse_qkv

    s = {k.removeprefix("model.").removeprefix("visual."): v.float() for k, v in sd.items()}
    out = {
        "patch_embed.weight": s["patch_embed.proj.weight"].reshape(spec.hidden, -1),
        "merger_norm.weight": s["merger.ln_q.weight"],
        "merger_norm.bias": s["merger.ln_q.bias"],
        "merger_fc1.weight": s["merger.mlp.0.weight"],
        "merger_fc1.bias": s["merger.mlp.0.bias"],
        "merger_fc2.weight": s["merger.mlp.2.weight"],
        "merger_fc2.bias": s["merger.mlp.2.bias"],
    }
    names = (
        ("input_layernorm", "norm1"),
        ("self_attention.linear_proj", "attn.proj"),
        ("pre_mlp_layernorm", "norm2"),
        ("mlp.linear_fc1", "mlp.fc1"),
        ("mlp.linear_fc2", "mlp.fc2"),
    )
    for i in range(spec.layers):
        src, dst = f"blocks.{i}.", f"block.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = s[f"{src}attn.qkv.{kind}"].chunk(3)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, spec.heads)
            for ours, theirs in names:
                out[f"{dst}{ours}.{kind}"] = s[f"{src}{theirs}.{kind}"]
    return out
