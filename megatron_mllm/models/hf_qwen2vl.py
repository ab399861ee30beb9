"""Hugging Face's Qwen2-VL (`Qwen2VLForConditionalGeneration`) <-> our canonical weights: the
native-resolution tower (`models/qwen2_vision.py`) and a Qwen2 backbone with multimodal rotary
positions and Q/K/V biases. Fields we do not map are refused in one line naming them."""

from __future__ import annotations

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.hf_llava import (
    _fuse_qkv,
    _normalized,
    _split_qkv,
    canonical_to_decoder,
    decoder_to_canonical,
    hf_text_fields,
)

# Ours <- theirs, per vision block (weights and biases alike; the fused QKV apart).
_BLOCK = (
    ("input_layernorm", "norm1"),
    ("self_attention.linear_proj", "attn.proj"),
    ("pre_mlp_layernorm", "norm2"),
    ("mlp.linear_fc1", "mlp.fc1"),
    ("mlp.linear_fc2", "mlp.fc2"),
)
_MERGER = (("norm", "ln_q"), ("fc1", "mlp.0"), ("fc2", "mlp.2"))


def _get(config, name: str, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def config_from_qwen2vl(hf, text_len: int, image_size: int | None = None) -> MLLMConfig:
    """Our model for a transformers Qwen2VLConfig; `image_size`: the nominal image the planner
    costs (default: 8 merged windows a side)."""
    v, t = hf.vision_config, getattr(hf, "text_config", hf)
    refused = {
        "vision_config.hidden_act (only quick_gelu)": _get(v, "hidden_act") != "quick_gelu",
        "tie_word_embeddings (ours are not tied)": bool(_get(hf, "tie_word_embeddings", False))
        or bool(_get(t, "tie_word_embeddings", False)),
        "text_config.hidden_act (only silu)": _get(t, "hidden_act", "silu") != "silu",
    }
    wrong = [name for name, bad in refused.items() if bad]
    if wrong:
        raise ConfigError(f"this Qwen2-VL model has fields we do not map: {', '.join(wrong)}")
    rope = _get(t, "rope_parameters", None) or _get(t, "rope_scaling", None) or {}
    section = tuple(rope.get("mrope_section") or ())
    factor = v.patch_size * v.spatial_merge_size
    return MLLMConfig(
        vit_native=True,
        vit_activation="quick_gelu",
        vit_norm_eps=1e-6,
        image_size=image_size or 8 * factor,
        patch_size=v.patch_size,
        channels=_get(v, "in_channels", None) or _get(v, "in_chans", 3),
        vit_layers=v.depth,
        vit_hidden=v.embed_dim,
        vit_heads=v.num_heads,
        vit_ffn=int(v.embed_dim * v.mlp_ratio),
        vit_merge=v.spatial_merge_size,
        vit_temporal_patch=v.temporal_patch_size,
        llm_layers=t.num_hidden_layers,
        llm_hidden=t.hidden_size,
        llm_heads=t.num_attention_heads,
        llm_ffn=t.intermediate_size,
        llm_query_groups=_get(t, "num_key_value_heads", t.num_attention_heads),
        llm_normalization="RMSNorm",
        llm_swiglu=True,
        llm_bias=False,
        llm_qkv_bias=True,
        llm_norm_eps=t.rms_norm_eps,
        llm_mrope_section=section,
        rope_base=float(rope.get("rope_theta", _get(t, "rope_theta", 10000.0))),
        vocab_size=t.vocab_size,
        text_len=text_len,
    )


def _qwen2vl_keys(sd: dict) -> dict:
    """The hub's layout (visual.*, model.layers.*) and transformers 5's in-memory one
    (model.visual.*, model.language_model.*) -> visual.*, text.*, lm_head.*."""
    out = {}
    for key, t in sd.items():
        k = key.removeprefix("model.")
        if not k.startswith(("visual.", "lm_head.", "language_model.")):
            k = "language_model." + k
        out[k] = t
    return _normalized(out)


def qwen2vl_to_canonical(sd: dict, cfg: MLLMConfig) -> dict[str, torch.Tensor]:
    """A Qwen2-VL state dict -> our canonical weights for `cfg` (from `config_from_qwen2vl`)."""
    s = {k: v.detach().to(torch.float32) for k, v in _qwen2vl_keys(sd).items()}
    vis = {k.removeprefix("visual."): x for k, x in s.items() if k.startswith("visual.")}
    out = {"encoder.patch_embed.weight": vis["patch_embed.proj.weight"].reshape(cfg.vit_hidden, -1)}
    for ours, theirs in _MERGER:
        for kind in ("weight", "bias"):
            out[f"projector.{ours}.{kind}"] = vis[f"merger.{theirs}.{kind}"]
    for i in range(cfg.vit_layers):
        src, dst = f"blocks.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = vis[f"{src}attn.qkv.{kind}"].chunk(3)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, cfg.vit_heads)
            for ours, theirs in _BLOCK:
                out[f"{dst}{ours}.{kind}"] = vis[f"{src}{theirs}.{kind}"]
    return {**out, **decoder_to_canonical(s, cfg)}


def canonical_to_qwen2vl(state: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict:
    """`qwen2vl_to_canonical`'s inverse, in transformers 5's Qwen2-VL layout."""
    v, t = "model.visual.", "model.language_model."
    patch = (cfg.vit_hidden, cfg.channels, cfg.vit_temporal_patch, cfg.patch_size, cfg.patch_size)
    out = {
        f"{v}patch_embed.proj.weight": state["encoder.patch_embed.weight"].reshape(patch),
    }
    for ours, theirs in _MERGER:
        for kind in ("weight", "bias"):
            out[f"{v}merger.{theirs}.{kind}"] = state[f"projector.{ours}.{kind}"]
    for i in range(cfg.vit_layers):
        src, dst = f"encoder.layers.{i}.", f"{v}blocks.{i}."
        for kind in ("weight", "bias"):
            fused = state[f"{src}self_attention.linear_qkv.{kind}"]
            out[f"{dst}attn.qkv.{kind}"] = torch.cat(
                list(_split_qkv(fused, cfg.vit_heads, cfg.vit_heads))
            )
            for ours, theirs in _BLOCK:
                out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
    out.update(canonical_to_decoder(state, cfg, t))
    return out


def qwen2vl_config(cfg: MLLMConfig, image_token_id: int):
    """The transformers Qwen2VLConfig of our model (a Qwen2-VL-shaped one: native tower,
    multimodal positions, Q/K/V biases, RMSNorm, SwiGLU, no other bias)."""
    from transformers import Qwen2VLConfig

    need = dict(vit_native=True, llm_qkv_bias=True, llm_bias=False, llm_swiglu=True)
    need["llm_normalization"] = "RMSNorm"
    wrong = [k for k, x in need.items() if getattr(cfg, k) != x]
    if wrong or not cfg.llm_mrope_section:
        raise ConfigError(
            f"this checkpoint's model is not Qwen2-VL-shaped ({', '.join(wrong) or 'mrope'}); "
            "train with --encoder-arch qwen2vl --mrope-section ... --add-qkv-bias"
        )
    ffn = cfg.vit_ffn or 4 * cfg.vit_hidden
    if ffn % cfg.vit_hidden:
        raise ConfigError(
            f"the tower's MLP width {ffn} is not a whole multiple of its width "
            f"{cfg.vit_hidden}, which Qwen2-VL's mlp_ratio needs"
        )
    vision = dict(
        depth=cfg.vit_layers,
        embed_dim=cfg.vit_hidden,
        hidden_size=cfg.llm_hidden,
        num_heads=cfg.vit_heads,
        mlp_ratio=ffn // cfg.vit_hidden,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.vit_temporal_patch,
        spatial_merge_size=cfg.vit_merge,
        in_channels=cfg.channels,
        hidden_act="quick_gelu",
    )
    text = dict(
        **hf_text_fields(cfg),
        rope_parameters={
            "rope_type": "default",
            "mrope_section": list(cfg.llm_mrope_section),
            "rope_theta": cfg.rope_base,
        },
    )
    return Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
