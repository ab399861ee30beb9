"""Hugging Face Qwen2-VL <-> our checkpoints (tools/convert_hf.py, the architecture read from
config.json): the converted model gives transformers' logits on a conversation with two images
of different sizes, and converting back gives the same weights."""

import pytest
import torch

from tests.test_mrope import IMAGE_TOKEN, _hf_config

START, END = 101, 102  # vision start and end tokens


@pytest.fixture(scope="module")
def qwen2vl_dir(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = _hf_config()
    config.vision_start_token_id, config.vision_end_token_id = START, END
    root = tmp_path_factory.mktemp("qwen2vl")
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(root / "hf")
    return root


def _conversation(merge: int = 2):
    """Token ids with two images (4 x 4 and 4 x 6 patches: 4 and 6 merged tokens), their
    patches and grids."""
    grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
    tokens = [5, 6, START] + [IMAGE_TOKEN] * 4 + [END, 7, 8, 9, START]
    tokens += [IMAGE_TOKEN] * 6 + [END, 10, 11, 12]
    g = torch.Generator().manual_seed(1)
    patches = torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=g)
    return torch.tensor([tokens]), patches, grids


def _our_logits(rank: int, world: int, load_dir: str) -> torch.Tensor:
    from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch
    from megatron_mllm.models.stages import encode
    from megatron_mllm.models.weights import shapes_of
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import build_full_model
    from megatron_mllm.training import checkpointing
    from megatron_mllm.training.model_args import checkpoint_model_config, initial_weights

    cfg = checkpoint_model_config(checkpointing.read_common(load_dir))
    init_rank(rank, world, 0, 60.0)
    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    shapes = shapes_of(initial_weights(cfg, 0, groups))
    model = build_full_model(cfg)
    encoder, backbone = model.encoders[0], model.backbone
    checkpointing.load(load_dir, [(backbone, 0, 1, 0), (encoder, 0, 1, 0)], shapes, None)
    tokens, patches, grids = _conversation()
    pad = cfg.seq_len - tokens.shape[1]
    tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=torch.long)], 1)
    mask = tokens == IMAGE_TOKEN
    batch = MicroBatch(patches, tokens, torch.full_like(tokens, IGNORE_INDEX), mask,
                       grids=grids, merge=cfg.vit_merge)  # fmt: skip
    with torch.no_grad():
        logits = backbone(None, backbone.decoder_input([encode(encoder, batch)], batch), batch)
    return logits[:, : tokens.shape[1] - pad]


def _import(rank: int, world: int, load_dir: str, save_dir: str):
    from megatron_mllm.training.convert_hf import hf_to_mcore

    return hf_to_mcore(load_dir, save_dir, 32, image_size=16)


def _export(rank: int, world: int, load_dir: str, save_dir: str) -> None:
    from megatron_mllm.training.convert_hf import mcore_to_hf

    mcore_to_hf(load_dir, save_dir)


def test_converted_qwen2vl_gives_transformers_logits_and_converts_back(qwen2vl_dir):
    from transformers import Qwen2VLForConditionalGeneration

    from megatron_mllm.runtime.assembly.launch import spawn

    hf_dir, ckpt, back = qwen2vl_dir / "hf", qwen2vl_dir / "ckpt", qwen2vl_dir / "back"
    # tools/convert_hf.py's functions (its command line: tests/test_llava_conversion.py)
    cfg = spawn(_import, 1, str(hf_dir), str(ckpt))[0]
    assert cfg.vit_native and cfg.llm_mrope_section == (2, 3, 3) and cfg.llm_qkv_bias
    ours = spawn(_our_logits, 1, str(ckpt))[0]
    hf = Qwen2VLForConditionalGeneration.from_pretrained(hf_dir).eval()
    tokens, patches, grids = _conversation()
    with torch.no_grad():
        theirs = hf(
            input_ids=tokens,
            pixel_values=patches,
            image_grid_thw=grids,
            mm_token_type_ids=(tokens == IMAGE_TOKEN).int(),
        ).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    spawn(_export, 1, str(ckpt), str(back))  # tools/convert_hf.py mcore-to-hf's function
    again = Qwen2VLForConditionalGeneration.from_pretrained(back).state_dict()
    original = hf.state_dict()
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_an_unmapped_qwen2vl_field_is_refused_before_anything_is_written(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from megatron_mllm.errors import ConfigError
    from megatron_mllm.training.convert_hf import hf_to_mcore

    config = _hf_config()
    config.vision_config.hidden_act = "gelu"
    Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="fields we do not map: vision_config.hidden_act"):
        hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "ckpt"), 32)
    assert not (tmp_path / "ckpt").exists()
