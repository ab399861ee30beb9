"""LLaVA records to model input (data/task_encoder.py): labels on assistant turns only, image
tokens where the text puts them, truncation that never splits an image, and image
preprocessing against a value computed by hand."""

import io

import pytest
import torch
from PIL import Image

from megatron_mllm.data.batch import IGNORE_INDEX, collate
from megatron_mllm.data.llava import IMAGE, LlavaRecord
from megatron_mllm.data.pixel_norms import CLIP_MEAN, CLIP_STD
from megatron_mllm.data.task_encoder import EncodeSpec, encode_record, preprocess_image
from megatron_mllm.data.tokenizer import train_tiny_tokenizer
from megatron_mllm.errors import ConfigError

TEXTS = ["What digit is shown?", "Which is larger? first second", "What is 4+3? 7 5"] * 20
T = 4  # image tokens per image


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=300)


def png(color=(255, 0, 0), size=(5, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def spec(tok, seq_length=64, **kw):
    return EncodeSpec(tok, seq_length, T, 8, **kw)


def decode_labels(tok, batch) -> str:
    labels = batch.labels[0]
    return tok.decode(labels[labels != IGNORE_INDEX])


def test_labels_only_on_assistant_turns(tok):
    rec = LlavaRecord("a", (), (("system", "Be brief."), ("human", "What is 4+3?"), ("gpt", "7")))
    batch = encode_record(rec, [], spec(tok))
    assert decode_labels(tok, batch) == "7</s>"
    assert batch.num_images == 0 and not batch.image_mask.any()
    # labels[j] is the token at j + 1: the answer's first token follows "assistant: ".
    first = int((batch.labels[0] != IGNORE_INDEX).nonzero()[0])
    assert tok.decode(batch.tokens[0, : first + 1]).endswith("assistant: ")
    with_prompt = encode_record(rec, [], spec(tok, loss_on_prompt=True))
    assert decode_labels(tok, with_prompt).endswith("What is 4+3?</s>assistant: 7</s>")


def test_image_tokens_sit_where_the_text_puts_them(tok):
    rec = LlavaRecord(
        "b",
        ("x.png", "y.png"),
        (("human", f"First {IMAGE} second {IMAGE}: larger?"), ("gpt", "first")),
    )
    batch = encode_record(rec, [png(), png((0, 0, 255))], spec(tok))
    assert batch.num_images == 2 and int(batch.image_mask.sum()) == 2 * T
    runs = batch.image_mask[0].nonzero().squeeze(1).tolist()
    assert runs[T - 1] + 1 < runs[T]  # text between the two images
    assert (batch.tokens[0][batch.image_mask[0]] == tok.image_token_id).all()
    assert (batch.labels[0][batch.image_mask[0]] == IGNORE_INDEX).all()
    assert tok.decode(batch.tokens[0, : runs[0]]) == "user: First "
    assert batch.truncated == 0 and decode_labels(tok, batch) == "first</s>"


def test_truncation_never_splits_an_image_and_is_counted(tok):
    rec = LlavaRecord("c", ("x.png", "y.png"), (("human", f"{IMAGE} and {IMAGE}"), ("gpt", "7")))
    full = encode_record(rec, [png(), png()], spec(tok))
    second = int(full.image_mask[0].nonzero()[T])  # where the second image starts
    cut = encode_record(rec, [png(), png()], spec(tok, seq_length=second + 2))
    assert cut.truncated == 1 and cut.num_images == 1 and int(cut.image_mask.sum()) == T
    assert not cut.image_mask[0, second:].any()  # the cut moved before the second image
    assert (cut.tokens[0, second:] == tok.pad_token_id).all()
    assert (cut.labels[0] == IGNORE_INDEX).all()  # the answer was cut off
    assert cut.no_answer == 1 and full.no_answer == 0  # and counted as such
    text = encode_record(
        LlavaRecord("d", (), (("human", "What is 4+3?"), ("gpt", "7"))), [], spec(tok)
    )
    both = collate([full, text, full])
    assert both.num_images == 4 and both.tokens.shape == (3, 64) and both.ids == ("c", "d", "c")
    assert collate([cut, cut]).no_answer == 2
    assert torch.equal(both.select([1, 2]).images, full.images)


def test_sequence_shorter_than_an_image_is_refused(tok):
    with pytest.raises(ConfigError, match="shorter than one image's 4 tokens"):
        spec(tok, seq_length=3).check()


def test_image_preprocessing_matches_a_hand_computed_value():
    # A 5x3 image of one colour resizes to that colour; CLIP's normalisation per channel.
    x = preprocess_image(png((255, 128, 0)), 8, CLIP_MEAN, CLIP_STD)
    assert x.shape == (3, 8, 8)
    expected = [(255 / 255 - CLIP_MEAN[0]) / CLIP_STD[0], (128 / 255 - CLIP_MEAN[1]) / CLIP_STD[1],
                (0 - CLIP_MEAN[2]) / CLIP_STD[2]]  # fmt: skip
    assert torch.allclose(x[:, 3, 4], torch.tensor(expected), atol=1e-6)
    # Grayscale (mode L) and palette images become RGB; [-1, 1] with the plain normalisation.
    buf = io.BytesIO()
    Image.new("L", (2, 2), 255).save(buf, format="PNG")
    assert torch.allclose(
        preprocess_image(buf.getvalue(), 4, (0.5,) * 3, (0.5,) * 3), torch.ones(3, 4, 4)
    )


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return train_tiny_tokenizer(TEXTS, tmp_path_factory.mktemp("qtok"), 300, template="qwen")


def test_the_qwen_template_wraps_each_image_in_vision_tokens(qwen_tok):
    from megatron_mllm.data.task_encoder import check_tokenizer

    tok = qwen_tok
    check_tokenizer(tok, "qwen")
    start, end = tok.image_wrap
    assert tok.image_token == "<|image_pad|>" and tok.convert_ids_to_tokens(start) == (
        "<|vision_start|>"
    )
    rec = LlavaRecord(
        "q", ("x.png", "y.png"), (("human", f"First {IMAGE} second {IMAGE}?"), ("gpt", "first"))
    )
    batch = encode_record(rec, [png(), png()], spec(tok))
    ids = batch.tokens[0].tolist()
    starts = [i for i, t in enumerate(ids) if t == start]
    assert len(starts) == 2 and batch.num_images == 2
    for s in starts:  # <|vision_start|>, T image pads, <|vision_end|>
        assert ids[s + 1 : s + 1 + T] == [tok.image_token_id] * T and ids[s + 1 + T] == end
        assert batch.image_mask[0, s + 1 : s + 1 + T].all() and not batch.image_mask[0, s]
    assert tok.decode(ids[: starts[0]]) == "<|im_start|>user\nFirst "
    assert decode_labels(tok, batch) == "first<|im_end|>\n"
    # A cut inside the second image's wrapping moves before its <|vision_start|>.
    for length in (starts[1] + 1, starts[1] + 1 + T):  # its start kept; its end cut
        cut = encode_record(rec, [png(), png()], spec(tok, seq_length=length))
        kept = cut.tokens[0, : starts[1]].tolist()
        assert cut.num_images == 1 and kept == ids[: starts[1]]
        assert (cut.tokens[0, starts[1] :] == tok.pad_token_id).all()
