"""Hugging Face tokenizers from a local directory (Megatron's `--tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR`; nothing is downloaded), and the tiny one trained
offline on the digits data set: byte-level BPE with an image token and a chat template.

The plain template (for a tokenizer without one): each turn as "<role>: text</s>", the roles
"system", "user" (LLaVA's human) and "assistant" (gpt). The Qwen template (`template="qwen"`):
Qwen2-VL's ChatML turns ("<|im_start|>role\ntext<|im_end|>\n") and its vision tokens; an image is
"<|vision_start|>", one "<|image_pad|>" per image token, "<|vision_end|>". Any tokenizer whose
image token is "<|image_pad|>" and that has Qwen's vision start and end tokens (a real Qwen2-VL
one) gets that image layout (`image_wrap`).
"""

from __future__ import annotations

from pathlib import Path

from megatron_mllm.errors import ConfigError

IMAGE_TOKEN = "<image>"
SPECIALS = ("<pad>", "<s>", "</s>", IMAGE_TOKEN)
QWEN_IMAGE_TOKEN = "<|image_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END,
                 QWEN_IMAGE_TOKEN)  # fmt: skip
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def train_tiny_tokenizer(
    texts: list[str], out: str | Path, vocab_size: int = 512, template: str = "plain"
):
    """Train byte-level BPE on `texts`, save it with the image token and the plain (or "qwen":
    ChatML with vision tokens) chat template as a Hugging Face tokenizer directory; returns the
    loaded tokenizer."""
    if template not in ("plain", "qwen"):
        raise ConfigError(f"chat template {template!r} is not one of plain, qwen")
    qwen = template == "qwen"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIALS if qwen else SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    if qwen:  # as Qwen2-VL's: no begin token, the end of a turn ends generation
        names = dict(pad_token="<|endoftext|>", eos_token="<|im_end|>")
        names["additional_special_tokens"] = list(QWEN_SPECIALS[1:])
    else:
        names = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>")
        names["additional_special_tokens"] = [IMAGE_TOKEN]
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **names)
    tok.chat_template = QWEN_TEMPLATE if qwen else PLAIN_TEMPLATE
    tok.save_pretrained(str(out))
    return load_tokenizer(out, QWEN_IMAGE_TOKEN if qwen else None)


def load_tokenizer(path: str | Path, image_token: str | None = None):
    """The tokenizer in a local directory, checked to have an image token (`image_token`, or
    `<image>`); one line naming what is missing otherwise."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--tokenizer-model {p}: not a directory (a Hugging Face tokenizer)")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--tokenizer-model {p}: no tokenizer there ({first})") from None
    token = image_token or IMAGE_TOKEN
    if token not in tok.get_vocab():
        raise ConfigError(
            f"--tokenizer-model {p}: no image token {token!r} in its vocabulary; give "
            "--image-token with one it has"
        )
    if tok.chat_template is None:
        tok.chat_template = PLAIN_TEMPLATE
    tok.image_token = token
    tok.image_token_id = tok.convert_tokens_to_ids(token)
    vocab = tok.get_vocab()
    qwen = token == QWEN_IMAGE_TOKEN and VISION_START in vocab and VISION_END in vocab
    tok.image_wrap = (vocab[VISION_START], vocab[VISION_END]) if qwen else ()
    return tok


# The files that define a Hugging Face tokenizer's behaviour (whichever a directory has).
DEFINING_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def tokenizer_identity(path: str | Path, image_token: str | None = None) -> dict:
    """What a checkpoint records of its tokenizer: a SHA-256 over the files that define it and
    the image token; a run resumed with another is refused (resume_contract.py)."""
    import hashlib

    digest = hashlib.sha256()
    for name in DEFINING_FILES:
        f = Path(path) / name
        if f.is_file():
            digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return {"sha256": digest.hexdigest(), "image_token": image_token or IMAGE_TOKEN}
