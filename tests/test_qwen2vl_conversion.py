"""Hugging Face Qwen2-VL and Qwen2.5-VL <-> our checkpoints (tools/convert_hf.py, the
architecture read from config.json): the converted model gives transformers' logits on a
conversation with two images of different sizes, and converting back gives the same weights."""

import pytest
import torch

from tests.test_mrope import IMAGE_TOKEN, _hf_config

START, END = 101, 102  # vision start and end tokens


def _hf_class(family: str):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    return (
        Qwen2_5_VLForConditionalGeneration
        if family == "qwen2.5"
        else Qwen2VLForConditionalGeneration
    )


def qwen25_config():
    """test_mrope's model with Qwen2.5-VL's tower: RMSNorm, gated SiLU MLP (width 40), windows
    of 2 x 2 merged tokens (16 px) in layer 0, full attention in layer 1."""
    from transformers import Qwen2_5_VLConfig

    qwen2 = _hf_config()
    v = qwen2.vision_config
    vision = dict(depth=2, hidden_size=v.embed_dim, out_hidden_size=v.hidden_size,
                  intermediate_size=40, num_heads=v.num_heads, patch_size=v.patch_size,
                  spatial_merge_size=v.spatial_merge_size, window_size=16,
                  temporal_patch_size=v.temporal_patch_size, fullatt_block_indexes=[1])  # fmt: skip
    text = qwen2.text_config.to_dict()
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN)


@pytest.fixture(scope="module", params=["qwen2", "qwen2.5"])
def qwen2vl_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    config = qwen25_config() if request.param == "qwen2.5" else _hf_config()
    config.vision_start_token_id, config.vision_end_token_id = START, END
    root = tmp_path_factory.mktemp(request.param)
    model = _hf_class(request.param)(config).eval()
    for p in model.model.visual.parameters():  # norm weights start at one: make them matter
        p.data += 0.05 * torch.randn_like(p)
    model.save_pretrained(root / "hf")
    return root, request.param


def _conversation(merge: int = 2):
    """Token ids with two images (4 x 4 and 4 x 6 patches: 4 and 6 merged tokens), their
    patches and grids."""
    grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
    tokens = [5, 6, START] + [IMAGE_TOKEN] * 4 + [END, 7, 8, 9, START]
    tokens += [IMAGE_TOKEN] * 6 + [END, 10, 11, 12]
    g = torch.Generator().manual_seed(1)
    patches = torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=g)
    return torch.tensor([tokens]), patches, grids


def _our_logits(
    rank: int, world: int, load_dir: str, conversation: tuple | None = None
) -> torch.Tensor | None:
    """One rank of a TP=`world` forward of the checkpoint on `conversation` (token ids,
    patches, grids, image token; default `_conversation()`); rank 0 returns the whole
    vocabulary's logits."""
    import torch.distributed as dist

    from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch
    from megatron_mllm.models.stages import encode
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
    device = init_rank(rank, world, 0, 60.0)
    plan = ParallelPlan(1, world, 1)
    groups = build_colocated_groups(plan, plan, world, rank)
    shapes = shapes_of(initial_weights(cfg, 0, groups))
    tp = groups.coords.tp
    model = build_rank_model(
        cfg,
        BackbonePlacement(groups.backbone, world, tp),
        EncoderPlacement(groups.encoder, world, tp),
        device,
    )
    encoder, backbone = model.encoders[0], model.backbone
    checkpointing.load(load_dir, [(backbone, tp, world, 0), (encoder, tp, world, 0)], shapes, None)
    tokens, patches, grids, image = conversation or (*_conversation(), IMAGE_TOKEN)
    pad = cfg.seq_len - tokens.shape[1]
    tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=torch.long)], 1)
    batch = MicroBatch(patches, tokens, torch.full_like(tokens, IGNORE_INDEX), tokens == image,
                       grids=grids, merge=cfg.vit_merge)  # fmt: skip
    with torch.no_grad():
        logits = backbone(None, backbone.decoder_input([encode(encoder, batch)], batch), batch)
    logits = logits[:, : tokens.shape[1] - pad].contiguous()
    pieces = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(pieces, logits, group=groups.backbone.tp)
    return torch.cat(pieces, dim=-1) if rank == 0 else None


def _import(rank: int, world: int, load_dir: str, save_dir: str):
    from megatron_mllm.training.convert_hf import hf_to_mcore

    return hf_to_mcore(load_dir, save_dir, 32, image_size=16)


def _export(rank: int, world: int, load_dir: str, save_dir: str) -> None:
    from megatron_mllm.training.convert_hf import mcore_to_hf

    mcore_to_hf(load_dir, save_dir)


@pytest.fixture(scope="module")
def converted_qwen(qwen2vl_dir):
    """The Hugging Face model converted by tools/convert_hf.py's function (its command line:
    tests/test_llava_conversion.py): (root, family, the model's config, transformers' logits
    on `_conversation()`)."""
    from megatron_mllm.runtime.assembly.launch import spawn

    root, family = qwen2vl_dir
    cfg = spawn(_import, 1, str(root / "hf"), str(root / "ckpt"))[0]
    hf = _hf_class(family).from_pretrained(root / "hf").eval()
    tokens, patches, grids = _conversation()
    with torch.no_grad():
        theirs = hf(
            input_ids=tokens,
            pixel_values=patches,
            image_grid_thw=grids,
            mm_token_type_ids=(tokens == IMAGE_TOKEN).int(),
        ).logits
    return root, family, cfg, theirs


def test_converted_qwen2vl_gives_transformers_logits_and_converts_back(converted_qwen):
    from megatron_mllm.runtime.assembly.launch import spawn

    root, family, cfg, theirs = converted_qwen
    assert cfg.vit_native and cfg.llm_mrope_section == (2, 3, 3) and cfg.llm_qkv_bias
    assert (cfg.vit_swiglu, cfg.vit_window, cfg.vit_full_layers) == (
        (True, 16, (1,)) if family == "qwen2.5" else (False, 0, ())
    )
    ours = spawn(_our_logits, 1, str(root / "ckpt"))[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    back = root / "back"
    spawn(_export, 1, str(root / "ckpt"), str(back))  # tools/convert_hf.py mcore-to-hf's function
    again = _hf_class(family).from_pretrained(back).state_dict()
    original = _hf_class(family).from_pretrained(root / "hf").state_dict()
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


@pytest.mark.slow  # the TP=1 check above runs in make test; this one spawns two ranks
def test_the_converted_checkpoint_at_tp2_gives_transformers_logits(converted_qwen):
    """The same checkpoint loaded as two tensor-parallel shards (vision tower and backbone)."""
    from megatron_mllm.runtime.assembly.launch import spawn

    root, _, _, theirs = converted_qwen
    ours = spawn(_our_logits, 2, str(root / "ckpt"))[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


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


@pytest.fixture(scope="module")
def qwen_conversations(tmp_path_factory):
    """The tiny digits conversations with a Qwen-template tokenizer, converted for energon:
    (dataset folder, tokenizer folder, image folder)."""
    from megatron_mllm.data.energon_llava import convert_llava
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.tokenizer import train_tiny_tokenizer

    root = tmp_path_factory.mktemp("qwen_digits")
    json_path = write_llava_digits(root / "src", 60)
    train_tiny_tokenizer(conversation_texts(json_path), root / "tokenizer", 300, template="qwen")
    convert_llava(json_path, root / "src" / "images", root / "energon", 16, 0.2, progress=False)
    return root / "energon", root / "tokenizer", root / "src" / "images"


@pytest.mark.slow  # two conversions, a fine-tuning run and generation
@pytest.mark.parametrize("family", ["qwen2", "qwen2.5"])
def test_qwen_vl_fine_tunes_on_qwen_conversations_and_generates(
    tmp_path, qwen_conversations, family
):
    """A tiny random Qwen2-VL (Qwen2.5-VL) with the Qwen-template tokenizer's vocabulary and
    vision tokens: converted, fine-tuned on the digits conversations (each image
    <|vision_start|>, its pads, <|vision_end|>) under PP=2 Optimus with --use-checkpoint-args,
    converted back; the weights moved, the fine-tuned checkpoint and the converted-back model
    give the same logits on a conversation our task encoder built, and transformers'
    `generate` answers it with the token both rank first."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron_mllm.data.llava import IMAGE, LlavaRecord
    from megatron_mllm.data.native_images import NativeImageSpec
    from megatron_mllm.data.task_encoder import EncodeSpec, encode_record
    from megatron_mllm.data.tokenizer import QWEN_IMAGE_TOKEN, load_tokenizer
    from megatron_mllm.runtime.assembly.launch import spawn

    data, tokenizer, images = qwen_conversations
    tok = load_tokenizer(tokenizer, QWEN_IMAGE_TOKEN)
    config = qwen25_config() if family == "qwen2.5" else _hf_config()
    config.text_config.vocab_size = len(tok)
    config.image_token_id = tok.image_token_id
    config.vision_start_token_id, config.vision_end_token_id = tok.image_wrap
    hf_class = _hf_class(family)
    torch.manual_seed(0)
    hf_class(config).eval().save_pretrained(tmp_path / "hf")
    root = Path(__file__).resolve().parents[1]
    tool = [sys.executable, str(root / "tools" / "convert_hf.py")]
    run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)  # noqa: E731
    out = run([*tool, "hf-to-mcore", "--load-dir", str(tmp_path / "hf"), "--save-dir",
               str(tmp_path / "mc"), "--seq-length", "96", "--img-h", "16"])  # fmt: skip
    assert out.returncode == 0, out.stderr
    out = run([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(root / "pretrain_mllm.py"), "--pipeline-model-parallel-size", "2",
        "--bubble-schedule", "optimus", "--load", str(tmp_path / "mc"), "--use-checkpoint-args",
        "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer), "--image-token", QWEN_IMAGE_TOKEN,
        "--min-pixels", "64", "--max-pixels", "2304", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--num-workers", "0",
        "--save", str(tmp_path / "ft"),
    ])  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "iteration        3/       3" in out.stdout
    out = run([*tool, "mcore-to-hf", "--load-dir", str(tmp_path / "ft"), "--save-dir",
               str(tmp_path / "back")])  # fmt: skip
    assert out.returncode == 0, out.stderr
    back = hf_class.from_pretrained(tmp_path / "back").eval()
    assert (back.config.image_token_id, back.config.vision_start_token_id) == (
        tok.image_token_id, tok.image_wrap[0]
    )  # fmt: skip
    before = hf_class.from_pretrained(tmp_path / "hf").state_dict()
    after = back.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    record = LlavaRecord("q", ("x.png",), (("human", f"{IMAGE}\nWhat digit is shown?"),))
    native = NativeImageSpec(patch_size=4, min_pixels=64, max_pixels=2304)
    spec = EncodeSpec(tok, 96, 0, 16, native=native, packing=True)
    batch = encode_record(record, [sorted(images.glob("*.png"))[0].read_bytes()], spec)
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = torch.cat([batch.tokens, torch.tensor([prompt])], dim=1)
    assert ids[0].tolist().count(tok.image_wrap[0]) == 1
    kind = (ids == tok.image_token_id).int()
    conversation = (ids, batch.images, batch.grids, tok.image_token_id)
    ours = spawn(_our_logits, 1, str(tmp_path / "ft"), conversation)[0]
    with torch.no_grad():
        theirs = back(input_ids=ids, pixel_values=batch.images, image_grid_thw=batch.grids,
                      mm_token_type_ids=kind).logits  # fmt: skip
        generated = back.generate(
            input_ids=ids,
            pixel_values=batch.images,
            image_grid_thw=batch.grids,
            mm_token_type_ids=kind,
            max_new_tokens=4,
            do_sample=False,
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert generated.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in generated[0].tolist()
    assert generated[0, ids.shape[1]] == ours[0, -1].argmax()
