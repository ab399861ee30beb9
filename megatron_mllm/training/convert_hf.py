"""Hugging Face directories <-> our torch_dist checkpoints (behind tools/convert_hf.py and
tools/convert_llava.py): LLaVA (`models/hf_llava.py`), Qwen2-VL and Qwen2.5-VL
(`models/hf_qwen2vl.py`), the architecture read from config.json.

Both directions go through the canonical weights and the training code's
own checkpoint writer and reader on one gloo rank, so a converted checkpoint is exactly what
pretrain_mllm.py loads, under any pair of plans. Every check runs before the process group or
any output file is touched; nothing existing is overwritten.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.hf_llava import (
    canonical_to_llava,
    check_exportable,
    config_from_llava,
    llava_config,
    llava_to_canonical,
)
from megatron_mllm.models.hf_qwen2vl import family
from megatron_mllm.training.checkpointing import TRACKER


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory (safetensors, else PyTorch .bin shards)."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(str(f)).items()}
    out = {}
    for f in sorted(hf_dir.glob("pytorch_model*.bin")):
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def _one_rank_model(cfg: MLLMConfig, seed: int = 1234):
    """A gloo group of one and an unsharded encoder + backbone (checkpoint `parts`)."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.launch import free_port
    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    init_rank(0, 1, seed, 300.0)
    model = build_full_model(cfg)  # on the CPU: conversion reads and writes host tensors
    encoder, backbone = model.encoders[0], model.backbone
    return encoder, backbone, [(backbone, 0, 1, 0), (encoder, 0, 1, 0)]


def _architecture(hf, seq_length: int, image_size: int | None):
    """(our model, the state-dict mapping, the source's name) of a transformers config."""
    kind = getattr(hf, "model_type", None)
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        from megatron_mllm.models.hf_qwen2vl import config_from_qwen2vl, qwen2vl_to_canonical

        return config_from_qwen2vl(hf, seq_length, image_size), qwen2vl_to_canonical, kind
    if kind == "llava":
        return config_from_llava(hf, seq_length), llava_to_canonical, kind
    raise ConfigError(
        f"config.json's model_type {kind!r} is not one we convert; give a llava, qwen2_vl or "
        "qwen2_5_vl save_pretrained directory"
    )


def hf_to_mcore(
    load_dir: str, save_dir: str, seq_length: int, image_size: int | None = None
) -> MLLMConfig:
    """A LLaVA, Qwen2-VL or Qwen2.5-VL save_pretrained directory -> <save_dir>/iter_0000000
    (model only); `image_size`: a native-resolution tower's nominal image (the planner's)."""
    from transformers import AutoConfig

    src = Path(load_dir)
    if not (src / "config.json").is_file():
        raise ConfigError(f"--load-dir {load_dir}: no config.json (a save_pretrained directory)")
    if (Path(save_dir) / TRACKER).exists():
        raise ConfigError(
            f"--save-dir {save_dir} already holds a checkpoint; choose an empty directory"
        )
    hf = AutoConfig.from_pretrained(str(src))
    cfg, to_canonical, kind = _architecture(hf, seq_length, image_size)
    cfg.validate()
    from megatron_mllm.training.model_args import model_args

    args = model_args(cfg)
    canonical = to_canonical(read_hf_weights(src), cfg)

    import torch.distributed as dist

    from megatron_mllm.models.weights import canonical_names, load_full_state
    from megatron_mllm.training import checkpointing

    encoder, backbone, parts = _one_rank_model(cfg)
    expected = {c for m in (encoder, backbone) for c in canonical_names(m).values()}
    if expected != set(canonical):
        missing = sorted(expected - set(canonical))[:3]
        raise ConfigError(f"converted weights do not cover the model (e.g. {missing})")
    load_full_state(encoder, canonical, 0, 1)
    load_full_state(backbone, canonical, 0, 1)
    shapes = {k: tuple(v.shape) for k, v in canonical.items()}
    common = {
        "iteration": 0,
        "model_only": True,
        "args": args,
        "source": {"hf_dir": str(src), f"{kind}_config": hf.to_dict()},
    }
    checkpointing.save(save_dir, 0, parts, shapes, None, common)
    dist.destroy_process_group()
    return cfg


def mcore_to_hf(load_dir: str, save_dir: str, image_token_index: int | None = None):
    """The latest checkpoint under `load_dir` -> a LlavaForConditionalGeneration or (a
    native-resolution tower) a Qwen2VLForConditionalGeneration or (a gated one)
    Qwen2_5_VLForConditionalGeneration directory."""
    from megatron_mllm.training import checkpointing
    from megatron_mllm.training.model_args import checkpoint_model_config

    common = checkpointing.read_common(load_dir, "--load-dir")
    cfg = checkpoint_model_config(common)
    kind = family(cfg) if cfg.vit_native else "llava"
    if kind == "llava":
        check_exportable(cfg)
    source = common.get("source", {}).get(f"{kind}_config", {})
    if image_token_index is None:  # the source model's, else the last vocabulary entry
        key = "image_token_index" if kind == "llava" else "image_token_id"
        image_token_index = source.get(key, cfg.vocab_size - 1)
    if not 0 <= image_token_index < cfg.vocab_size:
        raise ConfigError(
            f"--image-token-index {image_token_index} is outside the vocabulary "
            f"0..{cfg.vocab_size - 1}"
        )
    out = Path(save_dir)
    if (out / "config.json").exists():
        raise ConfigError(f"--save-dir {save_dir} already holds a model; choose an empty directory")
    model, to_hf = _hf_model(cfg, kind, image_token_index, source)

    import torch.distributed as dist

    from megatron_mllm.models.weights import full_state

    encoder, backbone, parts = _one_rank_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in full_state(encoder, backbone).items()}
    checkpointing.load(load_dir, parts, shapes, None)
    state = full_state(encoder, backbone)
    dist.destroy_process_group()
    model.load_state_dict(to_hf(state, cfg), strict=True)
    model.save_pretrained(str(out))
    return model.config


def _hf_model(cfg: MLLMConfig, kind: str, image_token_index: int, source: dict):
    """An empty transformers model of our `cfg` and the mapping of our weights into it; a Qwen
    model keeps the `source` config's vision start, end and video token ids."""
    if kind != "llava":
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

        from megatron_mllm.models.hf_qwen2vl import QWEN25, canonical_to_qwen2vl, qwen2vl_config

        config = qwen2vl_config(cfg, image_token_index)
        for key in ("vision_start_token_id", "vision_end_token_id", "video_token_id"):
            if source.get(key) is not None:
                setattr(config, key, source[key])
        model = (
            Qwen2_5_VLForConditionalGeneration
            if kind == QWEN25
            else Qwen2VLForConditionalGeneration
        )
        return model(config), canonical_to_qwen2vl
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration(llava_config(cfg, image_token_index)), canonical_to_llava


def checkpoint_logits(
    rank: int, world: int, load_dir: str, tp: int, images: torch.Tensor, text: torch.Tensor
):
    """One rank (see `launch.spawn`) of a TP=`tp`, PP=1 forward of the checkpoint under
    `load_dir` on [image tokens; `text`]; rank 0 returns the full [b, s, vocab] logits."""
    import torch.distributed as dist

    from megatron_mllm.data.batch import image_then_text
    from megatron_mllm.models.weights import shapes_of
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import (
        BackbonePlacement,
        EncoderPlacement,
        build_rank_model,
    )
    from megatron_mllm.training import checkpointing
    from megatron_mllm.training.model_args import checkpoint_model_config, initial_weights

    cfg = checkpoint_model_config(checkpointing.read_common(load_dir))
    device = init_rank(rank, world, 1234, 120.0)
    plan = ParallelPlan(world // tp, tp, 1)
    groups = build_colocated_groups(plan, plan, world, rank)
    shapes = shapes_of(initial_weights(cfg, 1234, groups))
    c = groups.coords
    model = build_rank_model(
        cfg,
        BackbonePlacement(groups.backbone, tp, c.tp),
        EncoderPlacement(groups.encoder, tp, c.tp),
        device,
    )
    encoder, backbone = model.encoders[0], model.backbone
    batch = image_then_text(images, text, cfg.image_tokens).to(device, torch.float32)
    checkpointing.load(
        load_dir, [(backbone, c.tp, tp, c.dp), (encoder, c.tp, tp, c.dp)], shapes, None
    )
    with torch.no_grad():
        decoder_input = backbone.decoder_input([encoder(batch.images)], batch)
        logits = backbone(None, decoder_input, batch).contiguous()
    pieces = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(pieces, logits, group=groups.backbone.tp)
    dist.barrier()
    dist.destroy_process_group()
    return torch.cat(pieces, dim=-1).cpu() if rank == 0 else None
