"""Hugging Face's Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`) <-> our canonical weights: the native-resolution tower
(`models/qwen2_vision.py`; Qwen2.5-VL's with RMSNorm, a gated MLP and window attention) and a
Qwen2 backbone with multimodal rotary positions and Q/K/V biases. Fields we do not map are
refused in one line naming them."""

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

QWEN2 = "qwen2_vl"
QWEN25 = "qwen2_5_vl"
_BOTH = ("weight", "bias")


def _get(config, name: str, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def family(cfg: MLLMConfig) -> str:
    """The Hugging Face model type of a native-resolution model: Qwen2.5-VL's tower is the
    gated one."""
    return QWEN25 if cfg.vit_swiglu else QWEN2


def _tower_fields(kind: str, v) -> dict:
    """Our encoder fields for a Qwen2-VL or Qwen2.5-VL vision config (the common ones apart)."""
    if kind == QWEN25:
        full = tuple(int(i) for i in _get(v, "fullatt_block_indexes", ()))
        return dict(vit_hidden=v.hidden_size, vit_ffn=v.intermediate_size,
                    vit_activation="silu", vit_normalization="RMSNorm", vit_swiglu=True,
                    vit_window=int(_get(v, "window_size", 0)), vit_full_layers=full)  # fmt: skip
    return dict(vit_hidden=v.embed_dim, vit_ffn=int(v.embed_dim * v.mlp_ratio),
                vit_activation="quick_gelu")  # fmt: skip


def _refused(kind: str, hf) -> list[str]:
    v, t = hf.vision_config, getattr(hf, "text_config", hf)
    act = "silu" if kind == QWEN25 else "quick_gelu"
    refused = {
        f"vision_config.hidden_act (only {act})": _get(v, "hidden_act") != act,
        "tie_word_embeddings (ours are not tied)": bool(_get(hf, "tie_word_embeddings", False))
        or bool(_get(t, "tie_word_embeddings", False)),
        "text_config.hidden_act (only silu)": _get(t, "hidden_act", "silu") != "silu",
    }
    return [name for name, bad in refused.items() if bad]


def config_from_qwen2vl(hf, text_len: int, image_size: int | None = None) -> MLLMConfig:
    """Our model for a transformers Qwen2VLConfig or Qwen2_5_VLConfig; `image_size`: the
    nominal image the planner costs (default: 8 merged windows a side)."""
    kind = _get(hf, "model_type")
    v, t = hf.vision_config, getattr(hf, "text_config", hf)
    wrong = _refused(kind, hf)
    if wrong:
        name = "Qwen2.5-VL" if kind == QWEN25 else "Qwen2-VL"
        raise ConfigError(f"this {name} model has fields we do not map: {', '.join(wrong)}")
    rope = _get(t, "rope_parameters", None) or _get(t, "rope_scaling", None) or {}
    factor = v.patch_size * v.spatial_merge_size
    return MLLMConfig(
        vit_native=True,
        vit_norm_eps=1e-6,
        image_size=image_size or 8 * factor,
        patch_size=v.patch_size,
        channels=_get(v, "in_channels", None) or _get(v, "in_chans", 3),
        vit_layers=v.depth,
        vit_heads=v.num_heads,
        **_tower_fields(kind, v),
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
        llm_mrope_section=tuple(rope.get("mrope_section") or ()),
        rope_base=float(rope.get("rope_theta", _get(t, "rope_theta", 10000.0))),
        vocab_size=t.vocab_size,
        text_len=text_len,
    )


def _tower_pairs(cfg: MLLMConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(our tensor, the tower's tensors it concatenates) for every tensor of the tower and
    merger but the patch embedding and the fused QKV."""
    norm = ("weight",) if cfg.vit_normalization == "RMSNorm" else _BOTH
    mlp = ("mlp.gate_proj", "mlp.up_proj") if cfg.vit_swiglu else ("mlp.fc1",)
    down = ("mlp.down_proj",) if cfg.vit_swiglu else ("mlp.fc2",)
    merger = [("norm", ("ln_q",), norm), ("fc1", ("mlp.0",), _BOTH), ("fc2", ("mlp.2",), _BOTH)]
    block = [
        ("input_layernorm", ("norm1",), norm),
        ("self_attention.linear_proj", ("attn.proj",), _BOTH),
        ("pre_mlp_layernorm", ("norm2",), norm),
        ("mlp.linear_fc1", mlp, _BOTH),
        ("mlp.linear_fc2", down, _BOTH),
    ]
    pairs = [
        (f"projector.{ours}.{k}", tuple(f"merger.{t}.{k}" for t in theirs))
        for ours, theirs, kinds in merger
        for k in kinds
    ]
    for i in range(cfg.vit_layers):
        pairs += [
            (f"encoder.layers.{i}.{ours}.{k}", tuple(f"blocks.{i}.{t}.{k}" for t in theirs))
            for ours, theirs, kinds in block
            for k in kinds
        ]
    return pairs


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
    """A Qwen2-VL or Qwen2.5-VL state dict -> our canonical weights for `cfg` (from
    `config_from_qwen2vl`)."""
    s = {k: v.detach().to(torch.float32) for k, v in _qwen2vl_keys(sd).items()}
    vis = {k.removeprefix("visual."): x for k, x in s.items() if k.startswith("visual.")}
    out = {"encoder.patch_embed.weight": vis["patch_embed.proj.weight"].reshape(cfg.vit_hidden, -1)}
    out.update({ours: torch.cat([vis[t] for t in theirs]) for ours, theirs in _tower_pairs(cfg)})
    for i in range(cfg.vit_layers):
        for kind in _BOTH:
            q, k, v = vis[f"blocks.{i}.attn.qkv.{kind}"].chunk(3)
            fused = _fuse_qkv(q, k, v, cfg.vit_heads)
            out[f"encoder.layers.{i}.self_attention.linear_qkv.{kind}"] = fused
    return {**out, **decoder_to_canonical(s, cfg)}


def canonical_to_qwen2vl(state: dict[str, torch.Tensor], cfg: MLLMConfig) -> dict:
    """`qwen2vl_to_canonical`'s inverse, in transformers 5's layout."""
    v, t = "model.visual.", "model.language_model."
    patch = (cfg.vit_hidden, cfg.channels, cfg.vit_temporal_patch, cfg.patch_size, cfg.patch_size)
    out = {f"{v}patch_embed.proj.weight": state["encoder.patch_embed.weight"].reshape(patch)}
    for ours, theirs in _tower_pairs(cfg):
        out.update(zip([v + n for n in theirs], state[ours].chunk(len(theirs)), strict=True))
    for i in range(cfg.vit_layers):
        for kind in _BOTH:
            fused = state[f"encoder.layers.{i}.self_attention.linear_qkv.{kind}"]
            qkv = _split_qkv(fused, cfg.vit_heads, cfg.vit_heads)
            out[f"{v}blocks.{i}.attn.qkv.{kind}"] = torch.cat(list(qkv))
    out.update(canonical_to_decoder(state, cfg, t))
    return {k: x.contiguous() for k, x in out.items()}


def _check_qwen_shaped(cfg: MLLMConfig) -> None:
    need = dict(vit_native=True, llm_qkv_bias=True, llm_bias=False, llm_swiglu=True)
    need["llm_normalization"] = "RMSNorm"
    wrong = [k for k, x in need.items() if getattr(cfg, k) != x]
    if wrong or not cfg.llm_mrope_section:
        raise ConfigError(
            f"this checkpoint's model is not Qwen2-VL-shaped ({', '.join(wrong) or 'mrope'}); "
            "train with --encoder-arch qwen2vl or qwen2.5vl --mrope-section ... --add-qkv-bias"
        )


def _vision_config(cfg: MLLMConfig) -> dict:
    """Our tower in Qwen2-VL's or Qwen2.5-VL's vision-config names."""
    ffn = cfg.vit_ffn or 4 * cfg.vit_hidden
    common = dict(
        depth=cfg.vit_layers,
        num_heads=cfg.vit_heads,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.vit_temporal_patch,
        spatial_merge_size=cfg.vit_merge,
        in_channels=cfg.channels,
    )
    if family(cfg) == QWEN25:
        return dict(common, hidden_size=cfg.vit_hidden, out_hidden_size=cfg.llm_hidden,
                    intermediate_size=ffn, hidden_act="silu", window_size=cfg.vit_window,
                    fullatt_block_indexes=list(cfg.vit_full_layers))  # fmt: skip
    if ffn % cfg.vit_hidden:
        raise ConfigError(
            f"the tower's MLP width {ffn} is not a whole multiple of its width "
            f"{cfg.vit_hidden}, which Qwen2-VL's mlp_ratio needs"
        )
    return dict(common, embed_dim=cfg.vit_hidden, hidden_size=cfg.llm_hidden,
                mlp_ratio=ffn // cfg.vit_hidden, hidden_act="quick_gelu")  # fmt: skip


def qwen2vl_config(cfg: MLLMConfig, image_token_id: int):
    """The transformers Qwen2VLConfig or Qwen2_5_VLConfig of our model (a Qwen2-VL-shaped one:
    native tower, multimodal positions, Q/K/V biases, RMSNorm, SwiGLU, no other bias)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    _check_qwen_shaped(cfg)
    text = dict(
        **hf_text_fields(cfg),
        rope_parameters={
            "rope_type": "default",
            "mrope_section": list(cfg.llm_mrope_section),
            "rope_theta": cfg.rope_base,
        },
    )
    kind = Qwen2_5_VLConfig if family(cfg) == QWEN25 else Qwen2VLConfig
    return kind(
        vision_config=_vision_config(cfg),
        text_config=text,
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
