"""Qwen2-VL's multimodal rotary positions and Qwen2's attention biases in the backbone: the 3-D
positions are Hugging Face's `get_rope_index` (also in packed rows, sample by sample), and the
backbone gives the logits of transformers' Qwen2-VL language model on the same weights."""

import random
from dataclasses import replace

import pytest
import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import TINY
from megatron_mllm.models.positions import mrope_position_ids
from megatron_mllm.runtime.assembly.launch import spawn

# Qwen2-shaped: RMSNorm, SwiGLU, biases on Q, K and V only, 2 KV groups, sections 2 + 3 + 3 over
# half of the 16-wide heads; 16-pixel images in 8-pixel patches: a 2 x 2 grid of image tokens.
CFG = replace(
    TINY,
    llm_layers=2,
    llm_ffn=128,
    llm_normalization="RMSNorm",
    llm_norm_eps=1e-6,
    llm_swiglu=True,
    llm_bias=False,
    llm_qkv_bias=True,
    llm_query_groups=2,
    llm_mrope_section=(2, 3, 3),
    image_size=16,
    text_len=20,
)
IMAGE_TOKEN = 100


def _hf_config():
    from transformers import Qwen2VLConfig

    text = dict(
        hidden_size=CFG.llm_hidden, intermediate_size=CFG.llm_ffn,
        num_hidden_layers=CFG.llm_layers, num_attention_heads=CFG.llm_heads,
        num_key_value_heads=CFG.llm_query_groups, vocab_size=CFG.vocab_size,
        rms_norm_eps=CFG.llm_norm_eps,
        rope_parameters={"rope_type": "default", "mrope_section": list(CFG.llm_mrope_section),
                         "rope_theta": CFG.rope_base},
    )  # fmt: skip
    # The vision tower's patch grid of 4 x 4 merges 2 x 2 into the backbone's 2 x 2 tokens.
    vision = dict(depth=1, embed_dim=32, hidden_size=CFG.llm_hidden, num_heads=2,
                  spatial_merge_size=2, patch_size=4, temporal_patch_size=2)  # fmt: skip
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN)


def _layout(rng: random.Random, length: int) -> list[int]:
    """A sample's token types (0 text, 1 image) of `length`: text runs and whole images, a
    text token after each image (as the vision-end token is)."""
    out = []
    while len(out) < length:
        after_image = out[-1:] == [1]
        out += [1] * 4 if length - len(out) >= 5 and not after_image and rng.random() < 0.4 else [0]
    return out


def _hf_positions(model, types: list[int]) -> torch.Tensor:
    ids = torch.tensor([[IMAGE_TOKEN if t else 1 for t in types]])
    grids = torch.tensor([[1, 4, 4]] * (sum(types) // 4))
    kind = torch.tensor([types], dtype=torch.int)
    return model.model.get_rope_index(ids, kind, grids if len(grids) else None)[0][:, 0]


@pytest.mark.parametrize("seed", range(4))
def test_positions_are_hugging_faces_sample_by_sample_in_packed_rows(seed):
    from transformers import Qwen2VLForConditionalGeneration

    rng = random.Random(seed)
    hf = Qwen2VLForConditionalGeneration(_hf_config())
    lengths = [rng.randint(6, 14) for _ in range(3)]
    samples = [_layout(rng, n) for n in lengths]
    types = [t for s in samples for t in s]
    assert any(types)
    positions = torch.tensor([p for s in samples for p in range(len(s))]).unsqueeze(0)
    mask = torch.tensor([types], dtype=torch.bool)
    ours = mrope_position_ids(mask, positions, CFG.image_grid)[:, 0]
    expected = torch.cat([_hf_positions(hf, s) for s in samples], dim=1)
    assert torch.equal(ours, expected)


def _logits_both(rank: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Qwen2VLForConditionalGeneration

    from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch
    from megatron_mllm.models.hf_llava import _normalized, decoder_to_canonical
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import build_full_model, seeded_state

    init_rank(rank, world, seed, 60.0)
    torch.manual_seed(seed)
    hf = Qwen2VLForConditionalGeneration(_hf_config()).eval()
    sd = {k: v.float() for k, v in _normalized(hf.state_dict()).items()}
    state = {**dict(seeded_state(CFG, seed)), **decoder_to_canonical(sd, CFG)}
    model = build_full_model(CFG, "cpu", state)
    types = [0] * 3 + [1] * 4 + [0] * 5 + [1] * 4 + [0] * 8
    tokens = torch.randint(1, CFG.vocab_size - 30, (1, len(types)))
    mask = torch.tensor([types], dtype=torch.bool)
    tokens[mask] = IMAGE_TOKEN
    images = torch.randn(4, 2, CFG.llm_hidden)  # each image's 4 token embeddings
    batch = MicroBatch(
        torch.zeros(2, 3, 16, 16), tokens, torch.full_like(tokens, IGNORE_INDEX), mask
    )
    backbone = model.backbone
    with torch.no_grad():
        ours = backbone(None, backbone.decoder_input([images], batch), batch)
        embeds = hf.model.language_model.embed_tokens(tokens)
        embeds[mask] = images.transpose(0, 1).reshape(-1, CFG.llm_hidden)
        pos = _hf_positions(hf, types).unsqueeze(1)
        hidden = hf.model.language_model(inputs_embeds=embeds, position_ids=pos)
        theirs = hf.lm_head(hidden.last_hidden_state)
    return ours, theirs


def test_the_backbone_gives_qwen2_vls_language_model_logits():
    ours, theirs = spawn(_logits_both, 1, 0)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_bad_sections_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="summing to half the head dim, 8"):
        replace(CFG, llm_mrope_section=(2, 2, 2)).validate()


@pytest.mark.parametrize(
    "schedule", [pytest.param("megatron", marks=pytest.mark.slow), "optimus"]
)  # make test runs the Optimus program; CI the Megatron one too
def test_pp2_with_multimodal_positions_matches_the_reference(schedule):
    """The Qwen2-shaped backbone on PP=2 (our executor on Megatron's and on the Optimus
    schedule): the one-process reference's losses and gradients."""
    from tests.test_runtime import check_pp2_matches_the_reference

    # the synthetic data's 32-pixel images: a 4 x 4 grid
    check_pp2_matches_the_reference(replace(CFG, image_size=32), schedule)
