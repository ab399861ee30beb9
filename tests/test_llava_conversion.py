"""Hugging Face LLaVA <-> our checkpoints: a tiny random LLaVA built by transformers itself,
converted, loaded under TP=1 and TP=2, and compared logit by logit; then converted back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from megatron_mllm.runtime.assembly.launch import spawn  # noqa: E402
from megatron_mllm.training.convert_hf import checkpoint_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "convert_llava.py")]
IMAGE_TOKEN = 99
TEXT = 6


def tiny_llava(
    image_size=16,
    patch_size=4,
    vocab_size=100,
    image_token=IMAGE_TOKEN,
    num_text_layers=2,
    **overrides,
):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    text = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=num_text_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=vocab_size,
        rope_theta=5000.0,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token, **overrides
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # make every weight (norms included) distinctive
        for p in model.parameters():
            p.normal_(0.0, 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    return model


def inputs(model):
    n = (16 // 4) ** 2
    torch.manual_seed(1)
    images = torch.randn(2, 3, 16, 16)
    text = torch.randint(0, IMAGE_TOKEN, (2, TEXT))
    ids = torch.cat([torch.full((2, n), IMAGE_TOKEN), text], dim=1)
    return images, text, ids


def hf_logits(model, images, ids):
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=images).logits


def convert(*args):
    out = subprocess.run([*TOOL, *map(str, args)], capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    model = tiny_llava()
    model.save_pretrained(root / "hf")
    rc, log = convert(
        "hf-to-mcore", "--load-dir", root / "hf", "--save-dir", root / "mcore", "--seq-length", TEXT
    )
    assert rc == 0, log
    return root, model


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_under_any_tp(converted, tp):
    root, model = converted
    images, text, ids = inputs(model)
    expected = hf_logits(model, images, ids)
    ours = spawn(checkpoint_logits, tp, str(root / "mcore"), tp, images, text)[0]
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 24 s; the logits tests convert in make test
def test_round_trip_back_to_hf(converted):
    from transformers import LlavaForConditionalGeneration

    root, model = converted
    rc, log = convert("mcore-to-hf", "--load-dir", root / "mcore", "--save-dir", root / "back")
    assert rc == 0, log
    back = LlavaForConditionalGeneration.from_pretrained(root / "back").eval()
    assert back.config.image_token_index == IMAGE_TOKEN
    images, _, ids = inputs(model)
    torch.testing.assert_close(
        hf_logits(back, images, ids), hf_logits(model, images, ids), rtol=1e-5, atol=1e-5
    )
    # Nothing existing is overwritten.
    rc, log = convert("mcore-to-hf", "--load-dir", root / "mcore", "--save-dir", root / "back")
    assert rc == 2 and log.count("\n") == 1 and "already holds a model" in log


@pytest.mark.slow  # 17 s; make test-slow
def test_converted_checkpoint_trains_under_another_plan(converted, tmp_path):
    """pretrain_mllm.py takes the model from the checkpoint and loads it on PP=2 (Optimus)."""
    from tests.ranks import pretrain

    root, _ = converted
    out = pretrain(
        "--pipeline-model-parallel-size", "2", "--load", str(root / "mcore"),
        "--use-checkpoint-args", "--train-iters", "2", "--global-batch-size", "4",
        "--save", str(tmp_path / "ft"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "model weights only" in out.stdout
    assert "iteration        2/       2" in out.stdout
    assert json.loads((tmp_path / "ft" / "latest_checkpointed_iteration.txt").read_text()) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(vision_feature_select_strategy="full"), "vision_feature_select_strategy"),
        pytest.param(
            dict(projector_hidden_act="relu"), "projector_hidden_act", marks=pytest.mark.slow
        ),
    ],
)
def test_unmapped_llava_variants_fail_clearly(tmp_path, overrides, message):
    tiny_llava(**overrides).save_pretrained(tmp_path / "hf")
    rc, log = convert("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "o")
    assert rc == 2 and log.count("\n") == 1 and message in log and "not mapped" in log
    assert not (tmp_path / "o").exists()


def test_other_architecture_fails_clearly(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=50,
        )
    ).save_pretrained(tmp_path / "hf")
    rc, log = convert("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "o")
    says = "model_type 'llama' is not one we convert; give a llava, qwen2_vl or qwen2_5_vl"
    assert rc == 2 and says in log


def test_a_model_with_several_encoders_does_not_export():
    from dataclasses import replace

    from megatron_mllm.errors import ConfigError
    from megatron_mllm.models.config import CLIP_VIT, LLAMA, MLLMConfig
    from megatron_mllm.models.hf_llava import check_exportable

    llava = MLLMConfig(**CLIP_VIT, **LLAMA)
    check_exportable(llava)  # one CLIP tower + Llama: exportable
    with pytest.raises(ConfigError, match="has 2 encoders; LLaVA has one vision tower"):
        check_exportable(replace(llava, extra_encoders=(MLLMConfig(**CLIP_VIT),)))


@pytest.mark.slow  # two conversions, a fine-tuning run and generation
def test_llava_fine_tunes_on_conversations_and_generates(tmp_path, llava_dataset):
    """A tiny random LLaVA with the data set's tokenizer (its image token, 384 ids): converted,
    fine-tuned on the LLaVA-format conversations under PP=2 Optimus, converted back; the
    weights moved and transformers' own `generate` answers a conversation with an image."""
    from transformers import LlavaForConditionalGeneration

    from megatron_mllm.data.llava import IMAGE, LlavaRecord
    from megatron_mllm.data.pixel_norms import CLIP_MEAN, CLIP_STD
    from megatron_mllm.data.task_encoder import EncodeSpec, encode_record
    from megatron_mllm.data.tokenizer import load_tokenizer

    data, tokenizer = llava_dataset
    tok = load_tokenizer(tokenizer)
    model = tiny_llava(32, 8, 384, tok.image_token_id)
    model.save_pretrained(tmp_path / "hf")
    rc, log = convert("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mc",
                      "--seq-length", 64)  # fmt: skip
    assert rc == 0, log
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(ROOT / "pretrain_mllm.py"), "--pipeline-model-parallel-size", "2",
        "--bubble-schedule", "optimus", "--load", str(tmp_path / "mc"), "--use-checkpoint-args",
        "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer), "--micro-batch-size", "2", "--global-batch-size",
        "4", "--train-iters", "3", "--lr", "1e-3", "--num-workers", "0",
        "--save", str(tmp_path / "ft"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "model weights only" in out.stdout and "iteration        3/       3" in out.stdout
    rc, log = convert("mcore-to-hf", "--load-dir", tmp_path / "ft", "--save-dir", tmp_path / "back")
    assert rc == 0, log
    back = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    assert back.config.image_token_index == tok.image_token_id  # the source's, kept
    before, after = model.state_dict(), back.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    record = LlavaRecord("q", ("x.png",), (("human", f"{IMAGE}\nWhat digit is shown?"),))
    images = sorted((data.parent / "src" / "images").glob("*.png"))[:1]
    spec = EncodeSpec(tok, 64, 16, 32, CLIP_MEAN, CLIP_STD)
    batch = encode_record(record, [images[0].read_bytes()], spec)
    answer_ids = tok("assistant: ", add_special_tokens=False)["input_ids"]
    n = int((batch.tokens[0] != tok.pad_token_id).sum())
    ids = torch.cat([batch.tokens[:, :n], torch.tensor([answer_ids])], dim=1)
    with torch.no_grad():
        generated = back.generate(
            input_ids=ids, pixel_values=batch.images, max_new_tokens=4, do_sample=False
        )
    assert generated.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in generated[0].tolist()


@pytest.mark.slow  # a conversion and a training job each
@pytest.mark.parametrize(
    "schedule, tp", [("optimus", 1), ("optimus-adaptive", 1), ("megatron", 1), ("optimus", 2)]
)
def test_a_converted_layer_count_pp_does_not_divide_trains_under_every_schedule(
    tmp_path, schedule, tp
):
    """3 text layers on PP 2 (split 1/2 or 2/1, as megatron-core can build it), the model taken
    from the converted checkpoint: Optimus (and optimus-adaptive, and Optimus under TP 2: 4
    heads split) loads and trains what the Megatron schedule does."""
    tiny_llava(num_text_layers=3).save_pretrained(tmp_path / "hf")
    rc, log = convert(
        "hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mcore",
        "--seq-length", TEXT,
    )  # fmt: skip
    assert rc == 0, log
    from tests.ranks import pretrain

    out = pretrain(
        "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", str(tp),
        "--bubble-schedule", schedule, "--load", str(tmp_path / "mcore"),
        "--use-checkpoint-args", "--train-iters", "2", "--global-batch-size", "4",
        nproc=2 * tp,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "iteration        2/       2" in out.stdout
