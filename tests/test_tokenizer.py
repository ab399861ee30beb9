"""The tiny Hugging Face tokenizer (data/tokenizer.py): trained offline, saved as a directory,
loaded locally with its image token and chat template; bad directories in one line."""

import pytest

from megatron_mllm.data.tokenizer import IMAGE_TOKEN, load_tokenizer, train_tiny_tokenizer
from megatron_mllm.errors import ConfigError

TEXTS = ["What digit is shown?", "How many digits does this strip show?", "What is 46+34?"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=300)


def test_image_token_is_one_id_and_text_round_trips(tokenizer):
    ids = tokenizer(f"{IMAGE_TOKEN}\nWhat digit is shown?", add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.image_token_id) == 1 and ids[0] == tokenizer.image_token_id
    assert tokenizer.decode(ids[1:]) == "\nWhat digit is shown?"
    assert len(tokenizer) <= 300


def test_chat_template_renders_the_turns(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
        tokenize=False,
    )
    assert text == "user: What is 2+3?</s>assistant: 5</s>"


def test_bad_tokenizer_directories_fail_in_one_line(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokenizer(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="no tokenizer there"):
        load_tokenizer(tmp_path)
    tokenizer.save_pretrained(tmp_path / "t")
    with pytest.raises(ConfigError, match="no image token '<img>'"):
        load_tokenizer(tmp_path / "t", image_token="<img>")
