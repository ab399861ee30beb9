"""Between pretrain_mllm.py's arguments and the model: `model_config` (arguments -> MLLMConfig),
its inverse `model_args`, the model a checkpoint's saved arguments describe, and the initial
canonical weights."""

from __future__ import annotations

import argparse
from dataclasses import replace

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import CLIP_VIT, NATIVE_ARCHS, NATIVE_VITS, MLLMConfig


def _encoder_fields(
    arch: str | None,
    activation: str | None,
    image_size: int,
    patch_size: int,
    channels: int,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int | None,
) -> dict:
    """MLLMConfig's encoder fields for one encoder (the first or an --extra-encoder)."""
    fields = dict(CLIP_VIT) if arch == "clip" else dict(NATIVE_VITS.get(arch, {}))
    if activation:
        fields["vit_activation"] = activation
    return dict(
        fields,
        image_size=image_size,
        patch_size=patch_size,
        channels=channels,
        vit_layers=layers,
        vit_hidden=hidden,
        vit_heads=heads,
        vit_ffn=ffn,
    )


def model_config(args: argparse.Namespace) -> MLLMConfig:
    """The model the arguments describe (see argument_checks.MODEL_ARGS and `model_args`)."""
    encoder = _encoder_fields(
        args.encoder_arch,
        args.encoder_activation,
        args.img_h,
        args.patch_dim,
        args.num_channels,
        args.encoder_num_layers,
        args.encoder_hidden_size,
        args.encoder_num_attention_heads,
        args.encoder_ffn_hidden_size,
    )
    if args.encoder_arch in NATIVE_ARCHS:
        encoder["vit_merge"] = getattr(args, "spatial_merge_size", 2)
        encoder["vit_temporal_patch"] = getattr(args, "temporal_patch_size", 2)
    if args.encoder_arch == "qwen2.5vl":
        encoder.update(_windows(args, encoder["vit_merge"]))
    cfg = MLLMConfig(
        **encoder,
        llm_layers=args.num_layers,
        llm_hidden=args.hidden_size,
        llm_heads=args.num_attention_heads,
        llm_ffn=args.ffn_hidden_size,
        vocab_size=args.vocab_size,
        text_len=args.seq_length,
        projector_bias=not args.disable_projector_bias,
        llm_normalization=args.normalization,
        llm_norm_eps=args.norm_epsilon,
        llm_swiglu=args.swiglu,
        llm_bias=not args.disable_bias_linear,
        llm_query_groups=args.num_query_groups if args.group_query_attention else None,
        rope_base=args.rotary_base,
        llm_qkv_bias=getattr(args, "add_qkv_bias", False),
        llm_mrope_section=tuple(getattr(args, "mrope_section", None) or ()),
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
        attention_dropout=getattr(args, "attention_dropout", 0.0),
        extra_encoders=tuple(
            extra_encoder_config(spec, args) for spec in getattr(args, "extra_encoder", [])
        ),
    )
    if getattr(args, "data_path", None):  # conversations: --seq-length holds image tokens too
        if args.seq_length <= cfg.image_tokens:
            raise ConfigError(
                f"--seq-length {args.seq_length} is shorter than one image's "
                f"{cfg.image_tokens} tokens; give at least {cfg.image_tokens + 1}"
            )
        cfg = replace(cfg, text_len=args.seq_length - cfg.image_tokens)
    cfg.validate(
        getattr(args, "tensor_model_parallel_size", 1),
        getattr(args, "encoder_tensor_model_parallel_size", None) or 1,
        getattr(args, "sequence_parallel", False),
    )
    return cfg


def extra_encoder_config(spec: str, args: argparse.Namespace) -> MLLMConfig:
    """An --extra-encoder SPEC as the encoder fields of an MLLMConfig (see encoder_config)."""
    from megatron_mllm.training.argument_checks import parse_encoder_spec

    fields = parse_encoder_spec(spec)
    return MLLMConfig(
        **_encoder_fields(
            fields.get("arch"),
            fields.get("activation"),
            fields.get("img-h", args.img_h),
            fields.get("patch-dim", args.patch_dim),
            args.num_channels,
            fields["num-layers"],
            fields["hidden-size"],
            fields["num-attention-heads"],
            fields.get("ffn-hidden-size"),
        )
    )


def _is_clip(cfg: MLLMConfig) -> bool:
    return all(getattr(cfg, k) == v for k, v in CLIP_VIT.items() if k != "vit_activation")


def encoder_spec(enc: MLLMConfig) -> str:
    """The inverse of `extra_encoder_config`: the --extra-encoder SPEC of an extra encoder."""
    spec = (
        f"num-layers={enc.vit_layers},hidden-size={enc.vit_hidden},"
        f"num-attention-heads={enc.vit_heads},img-h={enc.image_size},patch-dim={enc.patch_size},"
        f"arch={'clip' if _is_clip(enc) else 'vit'},activation={enc.vit_activation}"
    )
    return spec + (f",ffn-hidden-size={enc.vit_ffn}" if enc.vit_ffn else "")


def checkpoint_model_config(common: dict) -> MLLMConfig:
    """The model a checkpoint's common state describes (its saved arguments over defaults)."""
    from megatron_mllm.training.arguments import build_parser

    args = vars(build_parser().parse_args([]))
    args.update({k: v for k, v in common.get("args", {}).items() if k in args})
    return model_config(argparse.Namespace(**args))


def model_args(cfg: MLLMConfig) -> dict:
    """The inverse of `model_config`: argument values (MODEL_ARGS) that rebuild `cfg`."""
    clip = _is_clip(cfg)
    args = dict(
        num_layers=cfg.llm_layers,
        hidden_size=cfg.llm_hidden,
        num_attention_heads=cfg.llm_heads,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.text_len,
        encoder_num_layers=cfg.vit_layers,
        encoder_hidden_size=cfg.vit_hidden,
        encoder_num_attention_heads=cfg.vit_heads,
        img_h=cfg.image_size,
        patch_dim=cfg.patch_size,
        num_channels=cfg.channels,
        ffn_hidden_size=cfg.llm_ffn,
        encoder_ffn_hidden_size=cfg.vit_ffn,
        encoder_arch=_arch(cfg, clip),
        encoder_activation=cfg.vit_activation,
        normalization=cfg.llm_normalization,
        norm_epsilon=cfg.llm_norm_eps,
        swiglu=cfg.llm_swiglu,
        disable_bias_linear=not cfg.llm_bias,
        group_query_attention=cfg.llm_query_groups is not None,
        num_query_groups=cfg.llm_query_groups or 1,
        rotary_base=cfg.rope_base,
        disable_projector_bias=not cfg.projector_bias,
        extra_encoder=[encoder_spec(e) for e in cfg.extra_encoders],
        add_qkv_bias=cfg.llm_qkv_bias,
        mrope_section=tuple(cfg.llm_mrope_section) or None,
        spatial_merge_size=cfg.vit_merge,
        temporal_patch_size=cfg.vit_temporal_patch,
        encoder_window_size=cfg.vit_window if cfg.vit_swiglu else None,
        encoder_full_attention_layers=list(cfg.vit_full_layers) if cfg.vit_swiglu else None,
    )
    rebuilt = model_config(argparse.Namespace(**args))
    if rebuilt != cfg:
        diff = [k for k, v in vars(cfg).items() if getattr(rebuilt, k) != v]
        raise ConfigError(f"model fields {', '.join(diff)} have no pretrain_mllm.py argument")
    return args


def _arch(cfg: MLLMConfig, clip: bool) -> str:
    if cfg.vit_native:
        return "qwen2.5vl" if cfg.vit_swiglu else "qwen2vl"
    return "clip" if clip else "vit"


def _windows(args: argparse.Namespace, merge: int) -> dict:
    """Qwen2.5-VL's attention windows: --encoder-window-size pixels a side (default 4 merged
    tokens, Qwen2.5-VL's 112 px at patch 14), full attention in --encoder-full-attention-layers
    (default the last layer of each quarter of the tower, Qwen2.5-VL's 7 15 23 31 of 32)."""
    window = getattr(args, "encoder_window_size", None)
    full = getattr(args, "encoder_full_attention_layers", None)
    depth = args.encoder_num_layers
    if full is None:
        full = sorted({max(0, (k + 1) * depth // 4 - 1) for k in range(4)})
    return dict(
        vit_window=4 * args.patch_dim * merge if window is None else window,
        vit_full_layers=tuple(full),
    )


def initial_weights(cfg: MLLMConfig, seed: int, groups):
    """Initial canonical weights, the same on every rank and layout, each tensor drawn only
    where a rank loads it (`seeded_state`)."""
    from megatron_mllm.runtime.assembly.model_builder import seeded_state

    return seeded_state(cfg, seed, group=groups.solo)


def model_argv(cfg: MLLMConfig) -> list[str]:
    """`model_args(cfg)` as pretrain_mllm.py's command line (flags for the booleans)."""
    out: list[str] = []
    for name, value in model_args(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list):  # a repeatable flag
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, tuple):  # one flag of several values
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
