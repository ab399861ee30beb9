"""LLaVA conversations to model input: the chat template, image tokens where the text puts
them, labels on the assistant turns, images decoded and normalised, one sequence length.

* Text: the conversation is rendered with the tokenizer's chat template (human -> "user", gpt
  -> "assistant"), turn by turn, so each turn's piece is known; an assistant turn's piece is
  its header (the template's generation prompt, no loss) and its content (loss). Each piece is
  tokenised on its own; every `<image>` in it becomes the tokenizer's image token, repeated for
  the image's token count (every encoder's patches), between the tokenizer's vision start and
  end tokens where it has them (`image_wrap`: Qwen2-VL's layout).
* Labels: `labels[j]` is token j + 1 where that token is in an assistant content (or any text
  token with `loss_on_prompt`), else IGNORE_INDEX.
* Length: padded to `seq_length` (left unpadded for packing: `EncodeSpec.packing`), or cut
  there; a cut never splits an image (it moves before the image, whose file is then dropped)
  and is counted in `MicroBatch.truncated` (and in `no_answer` when it removed every answer
  token).
* Images: decoded with Pillow, RGB, resized (bicubic) to the encoder's square input and
  normalised per channel with the encoder's mean and std (CLIP's for a CLIP tower).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch, collate
from megatron_mllm.data.llava import IMAGE, LlavaRecord
from megatron_mllm.data.pixel_norms import PLAIN_MEAN, PLAIN_STD
from megatron_mllm.errors import ConfigError

CHAT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class EncodeSpec:
    """How records become samples (see the module docstring)."""

    tokenizer: object  # a loaded Hugging Face tokenizer with .image_token_id (data/tokenizer.py)
    seq_length: int
    image_tokens: int  # backbone positions per image
    image_size: int
    mean: tuple[float, float, float] = PLAIN_MEAN
    std: tuple[float, float, float] = PLAIN_STD
    loss_on_prompt: bool = False
    sources: tuple[str, ...] = ()  # the data set's source names; a sample's id is its index
    packing: bool = False  # samples unpadded (cut at seq_length still), for `batch.pack`
    native: object = None  # a data.native_images.NativeImageSpec: images at their own size

    @property
    def pad_id(self) -> int:
        """The token padding is made of: the tokenizer's pad token, else its end token."""
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad

    def check(self) -> None:
        if self.seq_length < self.image_tokens:
            raise ConfigError(
                f"--seq-length {self.seq_length} is shorter than one image's "
                f"{self.image_tokens} tokens; give at least {self.image_tokens + 1}"
            )


def preprocess_image(data: bytes, size: int, mean, std) -> torch.Tensor:
    """Encoded image bytes -> [3, size, size] float32, normalised per channel."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB").resize((size, size), Image.BICUBIC)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    x = pixels.view(size, size, 3).permute(2, 0, 1).float() / 255.0
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def _pieces(turns: tuple[tuple[str, str], ...], tokenizer) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is assistant content) pieces, in order."""
    messages = [{"role": CHAT_ROLES[r], "content": t} for r, t in turns]

    def render(upto: int, prompt: bool = False) -> str:
        if upto == 0 and not prompt:
            return ""
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=prompt
        )

    out, done = [], ""
    for i, m in enumerate(messages):
        head = render(i, prompt=True) if m["role"] == "assistant" else done
        full = render(i + 1)
        if not (head.startswith(done) and full.startswith(head)):
            raise ConfigError("the tokenizer's chat template does not render turn by turn")
        out += [(head[len(done) :], False), (full[len(head) :], m["role"] == "assistant")]
        done = full
    return [(text, answer) for text, answer in out if text]


def check_tokenizer(tokenizer, where: str) -> None:
    """One line, before training, for a tokenizer the task encoder cannot use: a chat template
    that does not render turn by turn, or neither a pad nor an end token to pad with."""
    turns = (("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"))
    try:
        _pieces(turns, tokenizer)
    except ConfigError as err:
        raise ConfigError(f"--tokenizer-model {where}: {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer-model {where}: no pad or end token to pad sequences with")


def tokenize_record(
    record: LlavaRecord, spec: EncodeSpec, lengths: list[int] | None = None
) -> tuple[list[int], list[bool], list[int]]:
    """Token ids, per token whether it is a loss target, and where each image's tokens start
    (before the length is fixed); `lengths`: each image's token count (default: the spec's)."""
    tok, ids, target, starts = spec.tokenizer, [], [], []
    start, end = getattr(tok, "image_wrap", ()) or (None, None)
    for text, answer in _pieces(record.turns, tok):
        for k, part in enumerate(text.split(IMAGE)):
            if k:
                n = lengths[len(starts)] if lengths is not None else spec.image_tokens
                wrapped = [start] * (start is not None)
                ids += wrapped
                starts.append(len(ids))
                ids += [tok.image_token_id] * n + [end] * (end is not None)
                target += [False] * (n + 2 * len(wrapped))
            piece = tok(part, add_special_tokens=False)["input_ids"] if part else []
            ids += piece
            target += [answer or spec.loss_on_prompt] * len(piece)
    return ids, target, starts


def encode_record(record: LlavaRecord, image_bytes: list[bytes], spec: EncodeSpec) -> MicroBatch:
    """One record as a one-sample micro-batch (see the module docstring)."""
    native = None
    if spec.native is not None:  # each image's patches first: its token count is its size's
        from megatron_mllm.data.native_images import preprocess_native

        native = [preprocess_native(b, spec.native) for b in image_bytes]
        merge = spec.native.merge
        lengths = [grid[1] * grid[2] // merge**2 for _, grid in native]
    else:
        lengths = [spec.image_tokens] * len(image_bytes)
    ids, target, starts = tokenize_record(record, spec, lengths)
    s = spec.seq_length
    truncated = len(ids) > s
    cut = s
    wrap = len(getattr(spec.tokenizer, "image_wrap", ()) or ()) // 2  # start and end tokens
    for start, n_img in zip(starts, lengths, strict=True):
        if start - wrap < cut < start + n_img + wrap:
            cut = start - wrap  # never split an image (or its wrapping): cut before it
    answered = any(target[1:])
    ids, target = ids[:cut], target[:cut]
    no_answer = int(truncated and answered and not any(target[1:]))
    kept = sum(start + n + wrap <= cut for start, n in zip(starts, lengths, strict=True))
    is_image = [False] * len(ids)
    for start, n_img in zip(starts[:kept], lengths[:kept], strict=True):
        is_image[start : start + n_img] = [True] * n_img
    n = len(ids)
    s = n if spec.packing else s
    tokens = torch.full((1, s), spec.pad_id, dtype=torch.long)
    tokens[0, :n] = torch.tensor(ids, dtype=torch.long)
    labels = torch.full((1, s), IGNORE_INDEX, dtype=torch.long)
    wanted = torch.tensor(target[1:], dtype=torch.bool)
    if n > 1:
        labels[0, : n - 1] = torch.where(wanted, tokens[0, 1:n], IGNORE_INDEX)
    mask = torch.zeros(1, s, dtype=torch.bool)
    mask[0, :n] = torch.tensor(is_image, dtype=torch.bool)
    meta = dict(ids=(record.id,), truncated=int(truncated), no_answer=no_answer)
    if native is not None:
        patches = [p for p, _ in native[:kept]]
        dim = spec.native.patch_dim
        return MicroBatch(
            torch.cat(patches) if patches else torch.empty(0, dim),
            tokens,
            labels,
            mask,
            grids=torch.tensor([g for _, g in native[:kept]], dtype=torch.long).reshape(-1, 3),
            merge=spec.native.merge,
            **meta,
        )
    images = [preprocess_image(b, spec.image_size, spec.mean, spec.std) for b in image_bytes[:kept]]
    size = spec.image_size
    stacked = torch.stack(images) if images else torch.empty(0, 3, size, size)
    return MicroBatch(stacked, tokens, labels, mask, image_tokens=spec.image_tokens, **meta)


def encode_batch(records: list[tuple[LlavaRecord, list[bytes]]], spec: EncodeSpec) -> MicroBatch:
    """Records (with their image bytes) as one micro-batch."""
    return collate([encode_record(r, b, spec) for r, b in records])
