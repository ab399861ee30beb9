"""The native-resolution vision towers of Qwen2-VL and Qwen2.5-VL from megatron-core parts.

Each image keeps its own size: its pixels are cut into patches of `patch_size` (two frames deep,
`temporal_patch_size`, as Qwen2-VL's processor repeats a still image), ordered so that every
`merge x merge` window of neighbouring patches is contiguous; the images of a micro-batch are
concatenated into one sequence of patches. The layers are megatron-core's TransformerLayers
(LayerNorm, biases, QuickGELU MLP) with 2-D rotary positions (each patch's row and column, on
the head's two halves) and attention only within an image (a block-diagonal mask); the patch
merger (LayerNorm, then an MLP over each window's patches side by side) gives one backbone token
per window. Qwen2.5-VL's tower differs in RMSNorm, a gated (SiLU) MLP, and window attention:
its patches are reordered window by window (each window `window` pixels a side) once at the
embedding, most layers attend only within a window, the `full_layers` within the whole image,
and the merger's tokens are put back in image order. Shapes follow megatron-core:
[patches, 1, hidden].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from megatron_mllm.models.positions import to_device
from megatron_mllm.models.units import UnitStage, layer_kernels
from megatron_mllm.schedule.cost_model import FORWARD_KERNELS


@dataclass(frozen=True)
class Qwen2VisionSpec:
    """The vision tower's shape (Hugging Face's `Qwen2VLVisionConfig` names in comments; the
    last four fields are Qwen2.5-VL's)."""

    layers: int = 32  # depth
    hidden: int = 1280  # embed_dim
    heads: int = 16  # num_heads
    ffn: int | None = None  # embed_dim * mlp_ratio (Qwen2.5-VL: intermediate_size); None: 4x
    out_hidden: int = 3584  # hidden_size: the backbone's
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge: int = 2  # spatial_merge_size
    channels: int = 3  # in_channels
    rope_theta: float = 10000.0
    norm: str = "LayerNorm"  # or "RMSNorm"
    gated: bool = False  # a gated MLP (gate_proj, up_proj, down_proj)
    activation: str = "quick_gelu"  # hidden_act: quick_gelu or silu
    window: int = 0  # window_size in pixels; 0: every layer attends the whole image
    full_layers: tuple[int, ...] = ()  # fullatt_block_indexes: the layers that do

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
    return owner_mask(
        torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]), device
    )


def owner_mask(lengths: torch.Tensor, device) -> torch.Tensor:
    """The boolean mask [1, 1, n, n] of consecutive blocks of `lengths` tokens, each attending
    only within itself."""
    owner = to_device(torch.repeat_interleave(torch.arange(len(lengths)), lengths), device)
    return (owner[:, None] != owner[None, :])[None, None]


def window_order(
    grid_thw: torch.Tensor, merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's windows: (the merged tokens' order, window by window, [tokens]; each window's
    merged tokens [windows]). Each frame's grid of merged tokens is tiled from its top left by
    `side` x `side` windows (the last row and column of windows may be smaller), windows in
    row-major order, tokens row-major within a window."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        ids = torch.arange(t * (h // merge) * (w // merge)).reshape(t, h // merge, w // merge)
        for frame in ids + offset:
            for r in range(0, frame.shape[0], side):
                for c in range(0, frame.shape[1], side):
                    order.append(frame[r : r + side, c : c + side].flatten())
                    lengths.append(order[-1].numel())
        offset += ids.numel()
    return torch.cat(order), torch.tensor(lengths)


class Qwen2VisionStage(UnitStage, nn.Module):
    """Stage `stage` of `num_stages` of the vision tower (layers split as megatron-core splits
    them over `pg.pp`) on TP group `pg.tp` of `tp` (the patch embedding and the merger are
    whole on every rank). Its work is a list of units, as `stages.EncoderStage`'s: [the patch
    embedding], each layer, [the merger]; `prepare(grids)` sets the micro-batch's attention
    mask and rotary angles first (the images' patch grids decide both)."""

    recompute_layers = False

    def __init__(
        self,
        spec: Qwen2VisionSpec,
        pg,
        tp: int = 1,
        stage: int = 0,
        num_stages: int = 1,
        index: int = 0,
        kernel_units: bool = False,
        **config_overrides,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.spec, self.index, self.stage, self.num_stages = spec, index, stage, num_stages
        self.kernel_units = kernel_units  # each layer as its eight kernels, the merger as two
        self.first, self.last = stage == 0, stage == num_stages - 1
        if self.first:
            self.patch_embed = nn.Linear(spec.patch_dim, spec.hidden, bias=False)
        self.block = TransformerBlock(
            _config(spec, tp, num_stages, **config_overrides), _layer_spec(),
            post_layer_norm=False, pre_process=self.first, post_process=False, pg_collection=pg,
        )  # fmt: skip
        if self.last:
            window = spec.hidden * spec.merge**2
            norm = nn.RMSNorm if spec.norm == "RMSNorm" else nn.LayerNorm
            self.projector = nn.ModuleDict(
                {
                    "norm": norm(spec.hidden, eps=1e-6),
                    "fc1": nn.Linear(window, window),
                    "fc2": nn.Linear(window, spec.out_hidden),
                }
            )
        dim = spec.hidden // spec.heads // 2  # each of row and column rotates half the head
        self.register_buffer(
            "inv_freq",
            1.0 / spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim),
            persistent=False,
        )
        self._mask = self._window_mask = self._rotary = self._order = self._restore = None

    def prepare(self, grids: torch.Tensor) -> None:
        """The micro-batch's images' (frames, rows, columns) of patches, for the units after."""
        device = self.inv_freq.device
        self._mask = block_diagonal_mask(grids, device)
        order = None
        if self.spec.window:
            side = self.spec.window // (self.spec.merge * self.spec.patch_size)
            tokens, lengths = window_order(grids, self.spec.merge, side)
            unit = self.spec.merge**2
            order = (tokens[:, None] * unit + torch.arange(unit)).flatten()
            self._window_mask = owner_mask(lengths * unit, device)
            self._order = to_device(order, device)
            self._restore = to_device(torch.argsort(tokens), device)
        self._rotary = self.rotary(grids, order)

    def rotary(self, grid_thw: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """megatron-core's rotary angles [patches, 1, 1, head dim]: rows on the first quarter,
        columns on the second, repeated for the rotate-half pairs (patches in `order`)."""
        pos = vision_position_ids(grid_thw, self.spec.merge)
        pos = to_device(pos if order is None else pos[order], self.inv_freq.device)
        angles = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, rows | columns]
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]

    def _unit_table(self) -> list[tuple[str, object, list]]:
        if getattr(self, "_units", None) is not None:
            return self._units
        units = []
        if self.first:
            embed = lambda st: (self._embed(st[0]),)  # noqa: E731
            units.append(("embed", embed, [*self.patch_embed.parameters()]))
        for layer in self.block.layers:
            params = [*layer.parameters()]
            if not self.kernel_units:
                run = lambda st, lay=layer: (self._layer(lay, st[0]),)  # noqa: E731
                units.append(("layer", run, params))
                continue
            mask = lambda lay=layer: self._layer_mask(lay)  # noqa: E731
            kernels = layer_kernels(layer, mask, lambda: self._rotary)
            units += [(n, fn, params) for n, fn in zip(FORWARD_KERNELS, kernels, strict=True)]
        if self.last:
            params = [*self.projector.parameters()]
            if self.kernel_units:
                units.append(("proj_fc1", lambda st: (self._merge_fc1(st[0]),), params))
                units.append(("proj_fc2", lambda st: (self._merge_fc2(st[0]),), params))
            else:
                merge = lambda st: (self._merge_fc2(self._merge_fc1(st[0])),)  # noqa: E731
                units.append(("projector", merge, params))
        self._units = units
        return units

    def _embed(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, patch_dim] -> [patches, 1, hidden], window by window if windowed."""
        x = self.patch_embed(patches if self._order is None else patches[self._order])
        return x.unsqueeze(1)

    def _layer_mask(self, layer) -> torch.Tensor:
        windowed = self.spec.window and layer.layer_number - 1 not in self.spec.full_layers
        return self._window_mask if windowed else self._mask

    def _layer(self, layer, x: torch.Tensor) -> torch.Tensor:
        mask = self._layer_mask(layer)
        out = layer(hidden_states=x, attention_mask=mask, rotary_pos_emb=self._rotary)
        return out[0] if isinstance(out, tuple) else out

    def _merge_fc1(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, 1, hidden] -> [windows, window]: each merge window's patches side by side,
        normed, through fc1 and its activation."""
        p = self.projector
        window = self.spec.hidden * self.spec.merge**2
        y = p["norm"](x.squeeze(1)).reshape(-1, window)
        return nn.functional.gelu(p["fc1"](y))

    def _merge_fc2(self, y: torch.Tensor) -> torch.Tensor:
        """-> [windows, 1, out_hidden], back in image order if windowed."""
        y = self.projector["fc2"](y)
        return (y if self._restore is None else y[self._restore]).unsqueeze(1)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """The whole stage on [patches, patch_dim] (first stage; else [patches, 1, hidden]) of
        images with patch grids `grids`."""
        if grids.shape[0] == 0:  # a micro-batch without images: nothing to compute
            width = self.spec.out_hidden if self.last else self.spec.hidden
            return patches.new_zeros(0, 1, width)
        self.prepare(grids)
        state = (patches,)
        for u in range(self.num_units):
            state = self.run_unit(u, state)
        return state[0]


def Qwen2VisionTower(spec: Qwen2VisionSpec, pg, tp: int = 1) -> Qwen2VisionStage:  # noqa: N802
    """The whole tower as one stage."""
    return Qwen2VisionStage(spec, pg, tp)


def _config(spec: Qwen2VisionSpec, tp: int, num_stages: int, **overrides):
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn or 4 * spec.hidden,
        normalization=spec.norm,
        gated_linear_unit=spec.gated,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=num_stages,
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
        activation_func=quick_gelu if spec.activation == "quick_gelu" else torch.nn.functional.silu,
        batch_p2p_comm=False,
        batch_p2p_sync=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _layer_spec():
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    layer = copy.deepcopy(vit_layer_specs.get_vit_layer_with_local_spec())
    layer.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return layer
