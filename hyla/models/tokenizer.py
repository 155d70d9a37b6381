"""Tokenizer of an HF checkpoint, in either released format:

- tokenizer.json (the `tokenizers` library) + tokenizer_config.json: `Tokenizer`, here;
- tiktoken.model + tokenizer_config.json (Kimi-Linear, Kimi K2 / K3):
  `hyla.models.tiktoken_tokenizer.TiktokenTokenizer`.

Both derive from `BaseTokenizer`, which holds what the rest of hyla uses: encode / decode,
`decode_stream` (incremental detokenisation), `grammar_vocab` (the vocabulary for xgrammar), the
special tokens and the chat template. `load_tokenizer` picks the format from the files present.

The chat template is kept (from tokenizer_config.json's `chat_template`, or chat_template.jinja /
chat_template.json next to it) for the server; rendering it needs jinja2 (the `serve` extra),
imported only when `apply_chat_template` is called.
"""

from __future__ import annotations

import json
import os
import re

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from hyla.models.piece_cache import PieceCache
from hyla.models.tokenizer_base import BaseTokenizer, IncrementalDecoder, _chat_template, _read_json


# Texts at least this long are encoded with the GIL released (Tokenizer.encode): ~0.3 ms of
# encoding; shorter ones are not worth the wait to take the GIL back.
LONG_TEXT_CHARS = 2048


class _HFDecodeStream:
    """`tokenizers`' own DecodeStream bound to its tokenizer: step(id) as IncrementalDecoder."""

    def __init__(self, tokenizer: _HFTokenizer, skip_special_tokens: bool, ids: list[int] | None):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tokenizer, token_id)


class Tokenizer(BaseTokenizer):
    """tokenizer.json (a `tokenizers.Tokenizer`, the `tokenizer` attribute) with tokenizer_config.json."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        super().__init__(config, chat_template)
        self.tokenizer = tokenizer
        self._splitter: _AddedTokenSplitter | None | bool = False  # False: not yet probed (_pieces)
        self.pieces = PieceCache()

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        splitter = self._pieces()
        if splitter is not None and not add_special_tokens:  # a chat prompt: the pieces of earlier turns are cached
            return splitter.encode(text, self.pieces, self._encode_many)
        return self._encode_many([text], add_special_tokens)[0]

    def _encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        # `tokenizers` holds the GIL through `encode` and releases it through `encode_batch` (the
        # same ids). A server encodes prompts in its HTTP thread while the engine thread runs
        # host-bound prefill steps: a burst of 16 agent turns of ~3.6K tokens held the GIL for
        # ~40 ms of a lone prefill step (py-spy, BENCHMARKS "The 48B shape served").
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _pieces(self) -> _AddedTokenSplitter | None:
        """The splitter of long texts at added tokens, or None where this tokenizer's pieces are not
        encoded independently (hyla.models.piece_cache); decided once."""
        if self._splitter is False:
            self._splitter = _AddedTokenSplitter.for_tokenizer(self.tokenizer, self._encode_many)
        return self._splitter

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def decode_stream(self, skip_special_tokens: bool = True, ids: list[int] | None = None) -> IncrementalDecoder:
        # tokenizers' DecodeStream: 2x faster than an offsets decoder in Python and as exact
        # (BENCHMARKS.md "Incremental detokenisation").
        return _HFDecodeStream(self.tokenizer, skip_special_tokens, ids)

    def grammar_vocab(self) -> tuple[list[str], str]:
        texts = self.tokenizer.get_vocab(with_added_tokens=True)
        vocab = [""] * max(self.vocab_size, max(texts.values(), default=-1) + 1)
        specials = {a.content for a in self.tokenizer.get_added_tokens_decoder().values() if a.special}
        for text, i in texts.items():
            if text not in specials:  # "": a special token, never text
                vocab[i] = text
        return vocab, self._vocab_type()

    def _vocab_type(self) -> str:
        """How the vocabulary writes bytes, from the decoder: ByteLevel (GPT-2's byte-to-unicode
        characters), ByteFallback (<0x0A> pieces), else the text itself."""
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
        if "ByteLevel" in kinds:
            return "BYTE_LEVEL"
        if "ByteFallback" in kinds:
            return "BYTE_FALLBACK"
        return "RAW"


class _AddedTokenSplitter:
    """A text cut where `tokenizers` cuts it before encoding: at the added tokens that match the
    raw text first, then, in the pieces between them, at those that match the normalised text
    (tokenizers' AddedVocabulary; leftmost, the longest at a position). Built only where each piece
    then encodes on its own (`for_tokenizer`)."""

    PROBE = "ab c  d\n\te f\u00e9 "  # text around the added tokens in the probe: spaces, a newline, a tab, non-ASCII

    def __init__(self, raw: list[str], normalized: list[str], ids: dict[str, int]):
        self.patterns = [re.compile("(" + "|".join(map(re.escape, sorted(group, key=len, reverse=True))) + ")")
                         for group in (raw, normalized) if group]
        self.ids = ids

    @classmethod
    def for_tokenizer(cls, tokenizer: _HFTokenizer, encode_many) -> _AddedTokenSplitter | None:
        """encode_many(texts) -> each text's ids without special tokens added (Tokenizer._encode_many)."""
        added = list(tokenizer.get_added_tokens_decoder().values())
        if not added:
            return None
        has_normalizer = json.loads(tokenizer.to_str()).get("normalizer") is not None
        if any(a.lstrip or a.rstrip or a.single_word or (a.normalized and has_normalizer) for a in added):
            return None  # the tokens' matches then depend on the text around them
        ids = {a.content: tokenizer.token_to_id(a.content) for a in added}
        splitter = cls([a.content for a in added if not a.normalized], [a.content for a in added if a.normalized], ids)
        return splitter if splitter._probe(sorted(ids)[:16], encode_many) else None

    def _probe(self, tokens: list[str], encode_many) -> bool:
        """Whether texts cut at these tokens encode as the whole does (a pre-tokenizer that adds a
        prefix space to the first piece only, say, would not)."""
        text = self.PROBE
        samples = [f"{t}{text}{t}{t}{text}" for t in tokens] + [text + "".join(tokens) + text + " " + text]
        return all(self.encode(s, None, encode_many) == w for s, w in zip(samples, encode_many(samples)))

    def cut(self, text: str) -> list[str]:
        """text -> [piece, added token, piece, ..., piece] (pieces may be empty)."""
        parts = [text]
        for pattern in self.patterns:
            parts = [q for i, p in enumerate(parts) for q in ([p] if i % 2 else pattern.split(p))]
        return parts

    def encode(self, text: str, cache: PieceCache | None, encode_many) -> list[int]:
        parts = self.cut(text)
        pieces = [p for p in parts[0::2] if p]
        encoded = iter(cache.encode(pieces, encode_many) if cache is not None else encode_many(pieces))
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.ids[part])
            elif part:
                ids += next(encoded)
        return ids


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


def has_tokenizer(path) -> bool:
    """Whether the checkpoint directory `path` holds a tokenizer file load_tokenizer reads
    (without one, an engine takes token-id prompts only)."""
    return any(os.path.isfile(os.path.join(os.fspath(path), name)) for name in TOKENIZER_FILES)


def load_tokenizer(path) -> BaseTokenizer:
    """The tokenizer of the checkpoint directory `path`: tokenizer.json if there is one (the
    `tokenizers` format), else tiktoken.model (Kimi's tiktoken format); with tokenizer_config.json
    (special tokens, chat template) when present. Raises ValueError when neither file is there."""
    path = os.fspath(path)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(file):
        return Tokenizer(_HFTokenizer.from_file(file), config, _chat_template(path, config))
    if os.path.isfile(os.path.join(path, "tiktoken.model")):
        # Imported here: that module builds on this one (BaseTokenizer), and only tiktoken
        # checkpoints need the tiktoken package.
        from hyla.models.tiktoken_tokenizer import load_tiktoken_tokenizer

        return load_tiktoken_tokenizer(path, config, _chat_template(path, config))
    hint = " (found tokenizer.model: SentencePiece is not supported)" if os.path.isfile(
        os.path.join(path, "tokenizer.model")) else ""
    raise ValueError(f"no tokenizer in {path}: looked for tokenizer.json and tiktoken.model{hint}")
