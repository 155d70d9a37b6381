"""Cached pieces of long prompts (hyla.models.piece_cache): the cache's own bookkeeping; a growing
conversation's prompts encode to the ids of the whole text at every turn, through the bundled
tokenizer.json and tokenizers built here with other pre-tokenizers and added-token flags; where a
tokenizer's pieces would depend on their neighbours it encodes the whole text instead."""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from hyla.models import load_tokenizer
from hyla.models import tokenizer as tokenizer_module
from hyla.models.default import default_model_path
from hyla.models.piece_cache import MIN_PIECE_CHARS, PieceCache

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|tool|>", "<|im_start|>x"]  # the last overlaps the first: longest wins


def test_cache_encodes_only_what_it_misses_and_drops_the_least_recently_used():
    calls = []

    def encode_many(texts):
        calls.append(list(texts))
        return [[len(t), ord(t[0])] for t in texts]

    def encode(pieces):  # each piece's ids as a list (a cached piece's come as the cache's own sequence)
        return [list(ids) for ids in cache.encode(pieces, encode_many)]

    cache = PieceCache(max_chars=3 * MIN_PIECE_CHARS)
    a, b, c = ("a" * MIN_PIECE_CHARS, "b" * MIN_PIECE_CHARS, "c" * MIN_PIECE_CHARS)
    short = "s" * (MIN_PIECE_CHARS - 1)
    assert encode([a, short, b]) == [[64, 97], [63, 115], [64, 98]]
    assert calls == [[a, short, b]]
    assert encode([b, short, a]) == [[64, 98], [63, 115], [64, 97]]
    assert calls[-1] == [short]  # short pieces are encoded every time; a and b came from the cache
    cache.encode([c], encode_many)  # full: 3 pieces of MIN_PIECE_CHARS
    cache.encode([a], encode_many)  # a used last: b is the least recently used
    cache.encode(["d" * MIN_PIECE_CHARS], encode_many)  # b dropped
    calls.clear()
    cache.encode([a, b, c], encode_many)
    assert calls == [[b]] and cache.hits > 0 and cache.misses > 0


def _conversation_prompts(tok, turns: int, seed: int) -> list[str]:
    """Chat-shaped prompts of a growing conversation: special tokens, spaces and newlines around
    them, non-ASCII text, a piece starting or ending with whitespace, over LONG_TEXT_CHARS."""
    rng = random.Random(seed)
    words = ["the", "fox", " ", "  ", "\n", "\t", "é", "你好", "don't", "123", "x", "tool_call", "{\"a\": 1}"]

    def text(n):
        return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(n))

    history = f"<|im_start|>system\n{text(900)}<|im_end|>\n"
    prompts = []
    for turn in range(turns):
        history += f"<|im_start|>user\n {text(150)}<|tool|>{text(60)} <|im_end|>\n<|im_start|>x{text(5)}"
        prompts.append(history + "<|im_start|>assistant\n")
        history += f"<|im_start|>assistant\n{text(80)}<|im_end|>\n"
    assert len(prompts[0]) >= tokenizer_module.LONG_TEXT_CHARS
    return prompts


def _trained(pre_tokenizer, normalizer=None, **added) -> tokenizer_module.Tokenizer:
    """A small BPE tokenizer trained here with the given pre-tokenizer, SPECIALS added with the
    given AddedToken flags."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    corpus = ["the fox don't 123 é 你好 tool_call {\"a\": 1}\n\t x " * 20]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.add_special_tokens([AddedToken(s, **added) for s in SPECIALS])
    return tokenizer_module.Tokenizer(tok, {})


@pytest.mark.parametrize("make", [
    lambda: load_tokenizer(default_model_path()),
    lambda: _trained(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    lambda: _trained(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    lambda: _trained(pre_tokenizers.Metaspace(prepend_scheme="first")),
    lambda: _trained(pre_tokenizers.Metaspace(prepend_scheme="always")),
    lambda: _trained(pre_tokenizers.Whitespace(), normalizers.Lowercase(), normalized=True),
    lambda: _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), rstrip=True),
    lambda: _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), lstrip=True, single_word=True),
], ids=["bundled", "bytelevel", "bytelevel-prefix", "metaspace-first", "metaspace-always",
        "normalized-tokens", "rstrip", "lstrip-single-word"])
def test_every_turn_encodes_as_the_whole_text(make):
    tok = make()
    if isinstance(tok.tokenizer, Tokenizer) and tok.tokenizer.get_added_tokens_decoder():
        tok.tokenizer.add_special_tokens([t for t in SPECIALS if tok.tokenizer.token_to_id(t) is None])
    for prompt in _conversation_prompts(tok, turns=4, seed=len(SPECIALS)):
        want = [e.ids for e in tok.tokenizer.encode_batch([prompt], add_special_tokens=False)][0]
        assert tok.encode(prompt, add_special_tokens=False) == want
    splitter = tok._pieces()
    if splitter is not None:
        assert tok.pieces.hits > 0  # the later turns found the earlier turns' pieces
    else:
        assert tok.pieces.hits == tok.pieces.misses == 0  # the whole text each time


def test_added_tokens_that_take_whitespace_are_not_cut_around():
    assert _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), rstrip=True)._pieces() is None
    assert _trained(pre_tokenizers.Whitespace(), normalizers.Lowercase(), normalized=True)._pieces() is None
    assert _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))._pieces() is not None
    assert load_tokenizer(default_model_path())._pieces() is not None  # the bundled model's prompts are cached
