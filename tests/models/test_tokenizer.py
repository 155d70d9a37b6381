"""load_tokenizer: tokenizer.json + tokenizer_config.json, special tokens, chat template."""

import pytest

from hyla.models import load_tokenizer


def test_encode_decode_matches_transformers(kimi_checkpoint):
    from transformers import PreTrainedTokenizerFast

    path = kimi_checkpoint("dense", with_tokenizer=True)
    tok = load_tokenizer(path)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    text = "the cat sat on the mat and the dog ran"
    assert tok.encode(text) == ref(text)["input_ids"]
    assert tok.encode(text)[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256  # fits the tiny model's vocab


def test_chat_template(kimi_checkpoint):
    tok = load_tokenizer(kimi_checkpoint("dense", with_tokenizer=True))
    messages = [{"role": "user", "content": "the cat"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|user|> the cat </s> <|assistant|>"
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids.count(tok.bos_token_id) == 1 and ids[-1] == tok.tokenizer.token_to_id("<|assistant|>")


def test_missing_tokenizer_json(tmp_path):
    """Neither tokenizer.json nor tiktoken.model (tests/models/test_tiktoken_tokenizer.py loads the latter)."""
    (tmp_path / "tokenizer.model").write_text("")
    with pytest.raises(ValueError, match=f"no tokenizer in {tmp_path}: .*tokenizer.json.*tiktoken.model"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_long_text_encodes_as_transformers(kimi_checkpoint, add_special_tokens):
    """Texts past LONG_TEXT_CHARS take encode_batch (the GIL released): the same ids as transformers,
    special tokens inside the text included."""
    from transformers import PreTrainedTokenizerFast

    from hyla.models import tokenizer as tokenizer_module

    path = kimi_checkpoint("dense", with_tokenizer=True)
    tok = load_tokenizer(path)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    text = " ".join(["the cat sat on the mat </s> and the dog ran"] * 80)
    assert len(text) >= tokenizer_module.LONG_TEXT_CHARS
    want = ref(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tok.encode(text, add_special_tokens=add_special_tokens) == want
    assert tok.encode(text[:100], add_special_tokens=add_special_tokens) == ref(
        text[:100], add_special_tokens=add_special_tokens)["input_ids"]
