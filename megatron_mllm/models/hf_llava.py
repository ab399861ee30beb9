"""Hugging Face LLaVA (transformers' LlavaForConditionalGeneration) <-> our canonical weights.

We map LLaVA with a CLIP vision tower, the two-layer GELU projector and a Llama language model:
the encoder becomes our CLIP-style ViT (class token, pre-norm, quick_gelu, no final norm) cut at
LLaVA's `vision_feature_layer`, the backbone a GPTModel with RMSNorm, SwiGLU, no biases and
grouped-query attention. Canonical weights are plan-independent (`models/weights.py`), so one
converted checkpoint loads under any pair of plans.

megatron-core's fused QKV weight is laid out per query group: [q heads of the group; k; v].
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import CLIP_VIT, LLAMA, MLLMConfig

# Per CLIP encoder layer: our (megatron-core) name -> transformers' name; q/k/v are fused apart.
_CLIP_LAYER_NAMES = (
    ("input_layernorm", "layer_norm1"),
    ("self_attention.linear_proj", "self_attn.out_proj"),
    ("pre_mlp_layernorm", "layer_norm2"),
    ("mlp.linear_fc1", "mlp.fc1"),
    ("mlp.linear_fc2", "mlp.fc2"),
)
MAPPED = "LLaVA (LlavaForConditionalGeneration) with a CLIP vision tower and a Llama language model"


def _get(config, name: str, default=None):
    return getattr(config, name, default)


def _rope_theta(text) -> float:
    params = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"rope type '{kind}' is not mapped; {MAPPED} with plain RoPE is")
    return float(params.get("rope_theta", _get(text, "rope_theta", 10000.0)))


def encoder_layers_used(num_layers: int, feature_layer) -> int:
    """Layers of the CLIP tower that LLaVA's `vision_feature_layer` output depends on
    (hidden_states[0] is the embeddings, hidden_states[i] the output of layer i)."""
    if not isinstance(feature_layer, int):
        raise ConfigError(
            f"vision_feature_layer {feature_layer!r} (several layers) is not mapped; "
            "a single layer index is"
        )
    used = num_layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= used <= num_layers:
        raise ConfigError(
            f"vision_feature_layer {feature_layer} selects no encoder layer of {num_layers}"
        )
    return used


def config_from_llava(hf, text_len: int) -> MLLMConfig:
    """Our model configuration for a transformers LlavaConfig; ConfigError if not mapped."""
    kind = _get(hf, "model_type")
    if kind != "llava":
        raise ConfigError(f"architecture '{kind}' is not mapped; {MAPPED} is")
    vision, text = hf.vision_config, hf.text_config
    if vision.model_type != "clip_vision_model" or text.model_type != "llama":
        raise ConfigError(
            f"LLaVA with a '{vision.model_type}' tower and a '{text.model_type}' language model "
            f"is not mapped; {MAPPED} is"
        )
    head_dim = _get(text, "head_dim") or text.hidden_size // text.num_attention_heads
    checks = [
        ("vision_feature_select_strategy", hf.vision_feature_select_strategy, "default"),
        ("projector_hidden_act", hf.projector_hidden_act, "gelu"),
        ("vision hidden_act", vision.hidden_act, ("quick_gelu", "gelu")),
        ("text hidden_act", text.hidden_act, "silu"),
        ("attention_bias", bool(_get(text, "attention_bias", False)), False),
        ("mlp_bias", bool(_get(text, "mlp_bias", False)), False),
        ("tie_word_embeddings", bool(_get(text, "tie_word_embeddings", False)), False),
        ("head_dim", head_dim, text.hidden_size // text.num_attention_heads),
    ]
    for field, value, wanted in checks:
        if value not in (wanted if isinstance(wanted, tuple) else (wanted,)):
            raise ConfigError(
                f"LLaVA {field} = {value!r} is not mapped; we map {wanted!r} ({MAPPED})"
            )
    if vision.image_size % vision.patch_size:
        raise ConfigError(
            f"CLIP image size {vision.image_size} is not a multiple of patch {vision.patch_size}"
        )
    return MLLMConfig(
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        channels=vision.num_channels,
        vit_layers=encoder_layers_used(vision.num_hidden_layers, hf.vision_feature_layer),
        vit_hidden=vision.hidden_size,
        vit_heads=vision.num_attention_heads,
        vit_ffn=vision.intermediate_size,
        llm_layers=text.num_hidden_layers,
        llm_hidden=text.hidden_size,
        llm_heads=text.num_attention_heads,
        llm_ffn=text.intermediate_size,
        vocab_size=text.vocab_size,
        text_len=text_len,
        **{**CLIP_VIT, "vit_activation": vision.hidden_act},
        vit_norm_eps=vision.layer_norm_eps,
        projector_bias=bool(_get(hf, "multimodal_projector_bias", True)),
        **{**LLAMA, "llm_norm_eps": text.rms_norm_eps},
        llm_query_groups=_get(text, "num_key_value_heads") or text.num_attention_heads,
        rope_base=_rope_theta(text),
    )


def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) -> megatron's fused layout."""
    rest = q.shape[1:]
    per_group = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _split_qkv(fused, groups: int, heads: int):
    rest = fused.shape[1:]
    hd = fused.shape[0] // (heads + 2 * groups)
    per = heads // groups
    x = fused.reshape(groups, (per + 2) * hd, *rest)
    q, k, v = x.split([per * hd, hd, hd], dim=1)
    return (t.reshape(-1, *rest) for t in (q, k, v))


def _normalized(sd: dict) -> dict:
    """transformers 4.x and 5.x state-dict layouts -> vision./projector./text./lm_head."""
    out = {}
    for key, t in sd.items():
        k = key.removeprefix("model.")
        for old, new in (
            ("vision_tower.vision_model.", "vision."),
            ("vision_tower.", "vision."),
            ("multi_modal_projector.", "projector."),
            ("language_model.model.", "text."),
            ("language_model.lm_head.", "lm_head."),
            ("language_model.", "text."),
        ):
            if k.startswith(old):
                k = new + k.removeprefix(old)
                break
        out[k] = t
    return out


def llava_to_canonical(sd: dict, cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """A LLaVA state dict -> our canonical weights for `cfg` (from `config_from_llava`)."""
    s = {k: v.detach().to(torch.float32) for k, v in _normalized(sd).items()}
    h = cfg.vit_hidden
    out = {
        "encoder.class_embedding": s["vision.embeddings.class_embedding"],
        "encoder.patch_embed.weight": s["vision.embeddings.patch_embedding.weight"].reshape(h, -1),
        "encoder.pos_embed": s["vision.embeddings.position_embedding.weight"].unsqueeze(1),
        "encoder.pre_layernorm.weight": s["vision.pre_layrnorm.weight"],
        "encoder.pre_layernorm.bias": s["vision.pre_layrnorm.bias"],
        "projector.encoder.linear_fc1.weight": s["projector.linear_1.weight"],
        "projector.encoder.linear_fc2.weight": s["projector.linear_2.weight"],
    }
    if cfg.projector_bias:
        out["projector.encoder.linear_fc1.bias"] = s["projector.linear_1.bias"]
        out["projector.encoder.linear_fc2.bias"] = s["projector.linear_2.bias"]
    for i in range(cfg.vit_layers):
        src, dst = f"vision.encoder.layers.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (s[f"{src}self_attn.{n}_proj.{kind}"] for n in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, cfg.vit_heads)
            for ours, theirs in _CLIP_LAYER_NAMES:
                out[f"{dst}{ours}.{kind}"] = s[f"{src}{theirs}.{kind}"]
    return {**out, **decoder_to_canonical(s, cfg)}


def decoder_to_canonical(s: dict, cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """A Llama- or Qwen2-style decoder (`_normalized` keys: text.*, lm_head.*; Q, K and V biases
    where `cfg.llm_qkv_bias`) -> our canonical backbone weights."""
    groups = cfg.llm_query_groups or cfg.llm_heads
    out = {
        "backbone.embedding.word_embeddings.weight": s["text.embed_tokens.weight"],
        "backbone.decoder.final_layernorm.weight": s["text.norm.weight"],
        "backbone.output_layer.weight": s["lm_head.weight"],
    }
    for i in range(cfg.llm_layers):
        src, dst = f"text.layers.{i}.", f"backbone.decoder.layers.{i}."
        kinds = ("weight", "bias") if cfg.llm_qkv_bias else ("weight",)
        for kind in kinds:
            q, k, v = (s[f"{src}self_attn.{n}_proj.{kind}"] for n in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, groups)
        out[f"{dst}self_attention.linear_proj.weight"] = s[f"{src}self_attn.o_proj.weight"]
        out[f"{dst}input_layernorm.weight"] = s[f"{src}input_layernorm.weight"]
        out[f"{dst}pre_mlp_layernorm.weight"] = s[f"{src}post_attention_layernorm.weight"]
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat(
            [s[f"{src}mlp.gate_proj.weight"], s[f"{src}mlp.up_proj.weight"]]
        )
        out[f"{dst}mlp.linear_fc2.weight"] = s[f"{src}mlp.down_proj.weight"]
    return out


def check_exportable(cfg: MLLMConfig) -> None:
    """ConfigError unless `cfg` is an architecture LLaVA can express."""
    if cfg.num_encoders > 1:
        raise ConfigError(
            f"this checkpoint's model has {cfg.num_encoders} encoders; LLaVA has one vision "
            "tower (train without --extra-encoder to export)"
        )
    wanted = {**CLIP_VIT, **LLAMA, "llm_norm_eps": cfg.llm_norm_eps}
    wanted["vit_activation"] = cfg.vit_activation
    have = asdict(cfg)
    wrong = [k for k, v in wanted.items() if have[k] != v]
    if wrong:
        raise ConfigError(
            f"this checkpoint's model is not LLaVA-shaped ({', '.join(wrong)} differ); only a "
            "model trained with --encoder-arch clip --normalization RMSNorm --swiglu "
            "--disable-bias-linear exports"
        )


def llava_config(cfg: MLLMConfig, image_token_index: int):
    """The transformers LlavaConfig of our model (all encoder layers used: feature layer -1)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    check_exportable(cfg)
    vision = CLIPVisionConfig(
        hidden_size=cfg.vit_hidden,
        intermediate_size=cfg.vit_ffn or 4 * cfg.vit_hidden,
        num_hidden_layers=cfg.vit_layers,
        num_attention_heads=cfg.vit_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        num_channels=cfg.channels,
        hidden_act=cfg.vit_activation,
        layer_norm_eps=cfg.vit_norm_eps,
    )
    text = LlamaConfig(
        **hf_text_fields(cfg),
        max_position_embeddings=max(cfg.seq_len, 2048),
        rope_theta=cfg.rope_base,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_index,
        image_seq_length=cfg.num_patches,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        multimodal_projector_bias=cfg.projector_bias,
        tie_word_embeddings=False,
    )


def canonical_to_llava(state: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict:
    """Our canonical weights -> a LLaVA state dict (transformers 5 layout)."""
    check_exportable(cfg)
    h, c, p = cfg.vit_hidden, cfg.channels, cfg.patch_size
    v, t = "model.vision_tower.", "model.language_model."
    out = {
        f"{v}embeddings.class_embedding": state["encoder.class_embedding"],
        f"{v}embeddings.patch_embedding.weight": state["encoder.patch_embed.weight"].reshape(
            h, c, p, p
        ),
        f"{v}embeddings.position_embedding.weight": state["encoder.pos_embed"].squeeze(1),
        f"{v}pre_layrnorm.weight": state["encoder.pre_layernorm.weight"],
        f"{v}pre_layrnorm.bias": state["encoder.pre_layernorm.bias"],
        # LLaVA never reads the tower's pooled output; an identity-like norm keeps it complete.
        f"{v}post_layernorm.weight": torch.ones(h),
        f"{v}post_layernorm.bias": torch.zeros(h),
        "model.multi_modal_projector.linear_1.weight": state["projector.encoder.linear_fc1.weight"],
        "model.multi_modal_projector.linear_2.weight": state["projector.encoder.linear_fc2.weight"],
    }
    if cfg.projector_bias:
        out["model.multi_modal_projector.linear_1.bias"] = state[
            "projector.encoder.linear_fc1.bias"
        ]
        out["model.multi_modal_projector.linear_2.bias"] = state[
            "projector.encoder.linear_fc2.bias"
        ]
    for i in range(cfg.vit_layers):
        src, dst = f"encoder.layers.{i}.", f"{v}encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, vv = _split_qkv(
                state[f"{src}self_attention.linear_qkv.{kind}"], cfg.vit_heads, cfg.vit_heads
            )
            for n, x in zip("qkv", (q, k, vv), strict=True):
                out[f"{dst}self_attn.{n}_proj.{kind}"] = x
            for ours, theirs in _CLIP_LAYER_NAMES:
                out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
    out.update(canonical_to_decoder(state, cfg, t))
    return {k: x.contiguous() for k, x in out.items()}


def hf_text_fields(cfg: MLLMConfig) -> dict:
    """Our backbone's shape in Hugging Face's Llama / Qwen2 text-config names."""
    return dict(
        hidden_size=cfg.llm_hidden,
        intermediate_size=cfg.llm_ffn or 4 * cfg.llm_hidden,
        num_hidden_layers=cfg.llm_layers,
        num_attention_heads=cfg.llm_heads,
        num_key_value_heads=cfg.llm_query_groups or cfg.llm_heads,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.llm_norm_eps,
    )


def canonical_to_decoder(state: dict, cfg: MLLMConfig, prefix: str) -> dict[str, torch.Tensor]:
    """`decoder_to_canonical`'s inverse: the decoder under `prefix` (e.g. "model.language_model.")
    and the LM head, in Hugging Face's Llama / Qwen2 names."""
    groups = cfg.llm_query_groups or cfg.llm_heads
    out = {
        f"{prefix}embed_tokens.weight": state["backbone.embedding.word_embeddings.weight"],
        f"{prefix}norm.weight": state["backbone.decoder.final_layernorm.weight"],
        "lm_head.weight": state["backbone.output_layer.weight"],
    }
    for i in range(cfg.llm_layers):
        src, dst = f"backbone.decoder.layers.{i}.", f"{prefix}layers.{i}."
        for kind in ("weight", "bias") if cfg.llm_qkv_bias else ("weight",):
            fused = state[f"{src}self_attention.linear_qkv.{kind}"]
            for n, x in zip("qkv", _split_qkv(fused, groups, cfg.llm_heads), strict=True):
                out[f"{dst}self_attn.{n}_proj.{kind}"] = x
        out[f"{dst}self_attn.o_proj.weight"] = state[f"{src}self_attention.linear_proj.weight"]
        out[f"{dst}input_layernorm.weight"] = state[f"{src}input_layernorm.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = state[f"{src}pre_mlp_layernorm.weight"]
        gate, up = state[f"{src}mlp.linear_fc1.weight"].chunk(2)
        out[f"{dst}mlp.gate_proj.weight"], out[f"{dst}mlp.up_proj.weight"] = gate, up
        out[f"{dst}mlp.down_proj.weight"] = state[f"{src}mlp.linear_fc2.weight"]
    return out
