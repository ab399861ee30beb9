"""One builder for the modules a rank holds: backbone chunks, encoder stages, their weights,
freezing and device. Every run mode, the training loop, profiling and the tools call it.

Modules are built on the CPU (megatron-core's `use_cpu_initialization`), moved to the rank's
device, then filled with this rank's shard of the canonical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.stages import BackboneStage, EncoderStage
from megatron_mllm.schedule.config import NO_RECOMPUTE, Recompute


@dataclass(frozen=True)
class BackbonePlacement:
    """Which backbone chunks this rank holds: stage `stage` of `pp`, `vpp` chunks each, TP
    rank `tp_rank` of `tp`, on the process groups `pg` (a ProcessGroupCollection)."""

    pg: object
    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    stage: int = 0
    vpp: int = 1
    sequence_parallel: bool = False
    config_overrides: dict = field(default_factory=dict)  # uneven splits, batch_p2p_comm, ...


@dataclass(frozen=True)
class EncoderPlacement:
    """This rank's stage of every encoder: stage `stage` of `stages`, TP rank `tp_rank` of
    `tp`, on `pg`; units of layer or kernel size."""

    pg: object
    tp: int = 1
    tp_rank: int = 0
    stage: int = 0
    stages: int = 1
    kernel_units: bool = False


@dataclass
class RankModel:
    """The modules one rank runs."""

    chunks: list[BackboneStage]  # one per model chunk (virtual stage); the last holds the loss
    encoders: list[EncoderStage | None]  # this rank's stage of each encoder, None where none
    device: torch.device

    @property
    def backbone(self) -> BackboneStage:
        return self.chunks[-1]

    @property
    def modules(self) -> list[nn.Module]:
        return [m for m in (*self.chunks, *self.encoders) if m is not None]

    def zero_grad(self) -> None:
        for module in self.modules:
            for p in module.parameters():
                p.grad = None


def _native_stage(cfg: MLLMConfig, e, recompute: Recompute, impl: str, precision: dict):
    """The native-resolution tower's stage this rank holds (layer or kernel units, local
    layers)."""
    from megatron_mllm.models.qwen2_vision import Qwen2VisionStage

    if recompute.vision or impl != "local":
        raise ConfigError(
            "the native-resolution tower runs megatron-core's local layers without "
            "recomputation; drop --recompute-vision and --transformer-impl transformer_engine"
        )
    return Qwen2VisionStage(
        cfg.vision_spec(), e.pg, e.tp, e.stage, e.stages, kernel_units=e.kernel_units, **precision
    )


def build_rank_model(
    cfg: MLLMConfig,
    backbone: BackbonePlacement,
    encoder: EncoderPlacement | None,
    device: torch.device | str = "cpu",
    full_state: dict[str, torch.Tensor] | None = None,
    frozen_encoder: bool = False,
    dtype: torch.dtype = torch.float32,
    recompute: Recompute = NO_RECOMPUTE,
    transformer_impl: str = "local",
) -> RankModel:
    """Build, place and load this rank's modules (`encoder` None: the rank holds no encoder;
    `full_state` None: keep the seed's initial weights). `dtype` bfloat16: parameters and
    activations in bf16 (megatron-core's bf16 configs; the canonical weights are cast);
    `recompute`: activation recomputation (see schedule.config.Recompute); `transformer_impl`:
    megatron-core's local layer specs, or Transformer Engine's (where it imports; thin, untested
    here: TE is on neither machine)."""
    from megatron_mllm.models.weights import load_full_state

    precision = _precision(dtype)
    encoders: list[EncoderStage | None] = [None] * cfg.num_encoders
    if encoder is not None and cfg.vit_native:
        encoders = [_native_stage(cfg, encoder, recompute, transformer_impl, precision)]
    elif encoder is not None:  # built first: a model from the seed draws its weights first
        e = encoder
        encoders = [
            EncoderStage(
                cfg,
                e.stage,
                e.stages,
                e.pg,
                e.tp,
                e.kernel_units,
                index=i,
                recompute_layers=recompute.vision,
                transformer_impl=transformer_impl,
                **precision,
            )
            for i in range(cfg.num_encoders)
        ]
    b = backbone
    overrides = {**precision, **recompute.backbone_overrides(), **b.config_overrides}
    if b.vpp > 1:  # megatron-core spreads the layers evenly over the virtual stages
        overrides["virtual_pipeline_model_parallel_size"] = b.vpp
    chunks = [
        BackboneStage(
            cfg,
            b.stage == 0 and v == 0,
            b.stage == b.pp - 1 and v == b.vpp - 1,
            b.pg,
            b.tp,
            b.pp,
            vp_stage=v if b.vpp > 1 else None,
            sequence_parallel=b.sequence_parallel,
            transformer_impl=transformer_impl,
            **overrides,
        )
        for v in range(b.vpp)
    ]
    model = RankModel(chunks, encoders, torch.device(device))
    for module in model.modules:
        module.to(model.device, dtype)  # also our own tensors (patch embedding, positions)
    if full_state is not None:
        for chunk in chunks:
            load_full_state(chunk, full_state, b.tp_rank, b.tp)
        for enc in encoders:
            if enc is not None:
                load_full_state(enc, full_state, encoder.tp_rank, encoder.tp)
    if frozen_encoder:
        for enc in encoders:
            if enc is not None:
                enc.freeze()
    return model


def build_job_model(model, backbone: BackbonePlacement, encoder, device) -> RankModel:
    """`build_rank_model` for a RuntimeJob's ModelParts (`model`): its config, weights (a
    mapping, a SeededState or a weights file), freezing, dtype, recomputation and layers."""
    from megatron_mllm.models.weights import open_full_state

    return build_rank_model(
        model.cfg,
        backbone,
        encoder,
        device,
        open_full_state(model.weights),
        model.frozen_encoder,
        model.dtype,
        model.recompute,
        model.transformer_impl,
    )


def _precision(dtype: torch.dtype) -> dict:
    """TransformerConfig fields for the parameter and pipeline dtype."""
    if dtype == torch.float32:
        return {}
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype}: use torch.float32, torch.bfloat16 or torch.float16")
    half = "bf16" if dtype == torch.bfloat16 else "fp16"
    return {half: True, "params_dtype": dtype, "pipeline_dtype": dtype}


def solo_groups(group=None):
    """A ProcessGroupCollection in which every group is `group` (default: the whole world,
    which must be one rank) — for unsharded, one-process models."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = group if group is not None else dist.group.WORLD
    pg = ProcessGroupCollection()
    for name in ("tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp"):
        setattr(pg, name, group)
    pg.embd = pg.pos_embd = None
    return pg


def build_full_model(
    cfg: MLLMConfig,
    device: torch.device | str = "cpu",
    full_state: dict[str, torch.Tensor] | None = None,
    frozen_encoder: bool = False,
    group=None,
    kernel_units: bool = False,
) -> RankModel:
    """The whole model, unsharded (TP = PP = 1), on the process group `group` (see
    `solo_groups`)."""
    pg = solo_groups(group)
    return build_rank_model(
        cfg,
        BackbonePlacement(pg),
        EncoderPlacement(pg, kernel_units=kernel_units),
        device,
        full_state,
        frozen_encoder,
    )


def seeded_state(cfg: MLLMConfig, seed: int, group=None):
    """The model's canonical initial weights as a SeededState (models/weights.py): names and
    shapes from the whole model built on the meta device (no memory), each tensor drawn only
    when a rank loads it."""
    from megatron_mllm.models.weights import SeededState, full_state

    model = build_full_model(cfg, device="meta", group=group)
    shapes = {k: tuple(v.shape) for k, v in full_state(*model.modules).items()}
    layers = {"backbone.": cfg.llm_layers}
    for e in range(cfg.num_encoders):
        layers["encoder." if e == 0 else f"encoder{e}."] = cfg.encoder_config(e).vit_layers
    return SeededState(shapes, seed, layers)
