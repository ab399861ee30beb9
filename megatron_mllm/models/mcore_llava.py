"""megatron-core's own LLaVAModel (Megatron-LM's multimodal example) <-> our canonical weights.

LLaVAModel holds `vision_model` (a CLIPViTModel of subtype "clip": class token, pre-norm, a
bias-free patch convolution, no final norm: our `--encoder-arch clip`), `vision_projection`
(megatron-core's MultimodalProjector, "mlp") and `language_model` (a GPTModel with RoPE).
Its parameters are megatron-core modules as ours are, so the mapping renames prefixes and
reshapes the three embedding tensors. Transformer Engine's layer specs fuse the layer norms into
the next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); those
names are read as the local spec's `input_layernorm` and `pre_mlp_layernorm`.
"""

from __future__ import annotations

import re

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import CLIP_VIT, MLLMConfig, transformer_config

PREFIXES = (  # theirs -> ours
    ("language_model.", "backbone."),
    ("vision_projection.", "projector."),
    ("vision_model.decoder.layers.", "encoder.layers."),
)
EMBEDDINGS = (  # theirs, ours
    ("vision_model.conv1.weight", "encoder.patch_embed.weight"),
    ("vision_model.position_embeddings.weight", "encoder.pos_embed"),
    ("vision_model.class_token", "encoder.class_embedding"),
    ("vision_model.ln_pre.weight", "encoder.pre_layernorm.weight"),
    ("vision_model.ln_pre.bias", "encoder.pre_layernorm.bias"),
)
TE_FUSED_NORMS = (  # Transformer Engine spec's name -> the local spec's
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)
_TE_NAME = re.compile(
    r"^(.*\.layers\.\d+\.)(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_"
)


def check_mappable(cfg: MLLMConfig) -> None:
    """ConfigError unless LLaVAModel (CLIP tower, MLP projector, RoPE GPT) can hold `cfg`."""
    wrong = [k for k, v in CLIP_VIT.items() if k != "vit_activation" and getattr(cfg, k) != v]
    if cfg.num_encoders > 1 or cfg.vit_native or wrong or cfg.channels != 3:
        why = ", ".join(wrong) or "its encoders or channels"
        raise ConfigError(
            f"megatron-core's LLaVAModel holds one CLIP tower on RGB images and this model differs "
            f"({why}); convert a model of --encoder-arch clip, --num-channels 3, one encoder"
        )
    if cfg.llm_mrope_section:
        raise ConfigError(
            "megatron-core's LLaVAModel runs its language model with 1-D RoPE; a model with "
            "--mrope-section does not map to it"
        )


def to_canonical(theirs: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """LLaVAModel state-dict names (either spec; `_extra_state` dropped) -> canonical weights.
    A name that maps nowhere is a ConfigError naming it."""
    out, h = {}, cfg.vit_hidden
    embeddings = dict(EMBEDDINGS)
    for name, value in theirs.items():
        if name.endswith("_extra_state"):
            continue
        name = _local_name(name)
        if name in embeddings:
            out[embeddings[name]] = value
            continue
        ours = next((o + name[len(t) :] for t, o in PREFIXES if name.startswith(t)), None)
        if ours is None:
            raise ConfigError(
                f"megatron-core LLaVA tensor {name} has no place in our model (we map "
                "language_model.*, vision_model.* of a CLIP tower, vision_projection.*)"
            )
        out[ours] = value
    for ours, shape in (
        ("encoder.patch_embed.weight", (h, -1)),
        ("encoder.pos_embed", (-1, 1, h)),
        ("encoder.class_embedding", (h,)),
    ):
        if ours in out:
            out[ours] = out[ours].reshape(shape)
    return out


def from_canonical(state: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """Canonical weights -> LLaVAModel's local-spec state-dict names and shapes."""
    h, p = cfg.vit_hidden, cfg.patch_size
    shapes = {
        "vision_model.conv1.weight": (h, cfg.channels, p, p),
        "vision_model.position_embeddings.weight": (-1, h),
        "vision_model.class_token": (1, 1, h),
    }
    embeddings = {ours: theirs for theirs, ours in EMBEDDINGS}
    out = {}
    for name, value in state.items():
        theirs = embeddings.get(name) or next(
            (t + name[len(o) :] for t, o in PREFIXES if name.startswith(o)), None
        )
        if theirs is None:
            raise ConfigError(f"our tensor {name} has no place in megatron-core's LLaVAModel")
        out[theirs] = value.reshape(shapes[theirs]) if theirs in shapes else value
    return out


def _local_name(name: str) -> str:
    """A Transformer Engine spec's fused-norm name as the local spec's."""
    m = _TE_NAME.match(name)
    if not m:
        return name
    local = dict(TE_FUSED_NORMS)[m[2] + ".layer_norm_"]
    return m[1] + local + name[m.end() :]


def unstack_layers(tensors: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """torch_dist keys (`...decoder.layers.<name>` with the layers stacked first, as
    megatron-core's sharded state dict saves them) -> one state-dict name per layer."""
    out = {}
    for key, value in tensors.items():
        head, sep, tail = key.partition("decoder.layers.")
        if not sep:
            out[key] = value
            continue
        layers = cfg.llm_layers if head.startswith("language_model.") else cfg.vit_layers
        if value.shape[0] != layers:
            raise ConfigError(
                f"megatron-core LLaVA tensor {key} stacks {value.shape[0]} layers where the model "
                f"flags give {layers}; pass the checkpoint's --num-layers / --encoder-num-layers"
            )
        for i in range(layers):
            out[f"{head}{sep}{i}.{tail}"] = value[i]
    return out


def build_llava_model(cfg: MLLMConfig, pg):
    """megatron-core's LLaVAModel of `cfg` with local layer specs on the host (one rank, `pg`:
    `model_builder.solo_groups()`), as Megatron-LM's multimodal example builds it."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_mllm.models.stages import _vit_layer_spec

    check_mappable(cfg)
    vision = transformer_config(cfg, "vit", 1, 1)
    vision.vision_model_type = "clip"
    projection = transformer_config(
        cfg, "projector", 1, 1, num_layers=1, ffn_hidden_size=cfg.llm_hidden
    )
    return LLaVAModel(
        language_transformer_config=transformer_config(cfg, "llm", 1, 1),
        language_transformer_layer_spec=gpt_layer_specs.get_gpt_layer_local_spec(
            normalization=cfg.llm_normalization
        ),
        language_vocab_size=cfg.vocab_size,
        language_max_sequence_length=cfg.seq_len,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=_vit_layer_spec("local"),
        drop_vision_class_token=True,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        language_position_embedding_type="rope",
        language_rotary_base=int(cfg.rope_base),
        img_h=cfg.image_size,
        img_w=cfg.image_size,
        patch_dim=cfg.patch_size,
        pg_collection=pg,
    )
