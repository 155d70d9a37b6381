"""Kimi's tiktoken tokenizer format (Kimi-Linear, Kimi K2 / K3 checkpoints ship no tokenizer.json).

Files of the checkpoint directory:
    tiktoken.model          one line per base token, "<base64 of its bytes> <rank>", ranks 0..N-1:
                            the byte-level BPE merge priority, and the token's id
    tokenizer_config.json   added_tokens_decoder {"<id>": {"content": "[BOS]", "special": true, ...}}
                            naming special ids from N on; bos_token / eos_token / unk_token /
                            pad_token; additional_special_tokens; optional add_bos_token /
                            add_eos_token; chat_template (or chat_template.jinja beside it)

Rules, as the released remote code (tokenization_kimi.py's TikTokenTokenizer) behaves when
transformers runs it (what vLLM serves):
    - Special ids are N .. N+255 (its num_reserved_special_tokens = 256), each named by
      added_tokens_decoder or else `<|reserved_token_{id}|>`. (Some Kimi-Linear revisions of that
      file reserve two more ids, N+256 and N+257, past the model's embedding: no model emits
      them, and here they exist only if added_tokens_decoder names them.)
    - encode: every special-token string in the text becomes its id; the text between is split
      by KIMI_PATTERN and each piece BPE-merged by rank (tiktoken). As in the released code, a
      segment is encoded in pieces of at most 400,000 characters and cut inside any run of more
      than 25,000 whitespace or non-whitespace characters (tiktoken's regex is slow on those),
      which changes the ids of such runs only.
    - No BOS / EOS is added (the released tokenizer adds none); tokenizer_config.json's
      add_bos_token / add_eos_token turn them on.
    - decode: the tokens' bytes joined and read as UTF-8 (an invalid sequence -> U+FFFD).
      skip_special_tokens drops transformers' "all special ids" only: the bos / eos / unk / pad
      tokens and additional_special_tokens. The other special ids (the tool-call markers, the
      reserved ones) stay in the text, as they do there. Ids outside the vocabulary decode to
      nothing (as in `tokenizers`).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import os
import re

import tiktoken

from hyla.models.piece_cache import PieceCache
from hyla.models.tokenizer_base import BaseTokenizer, IncrementalDecoder, _token_str

# Kimi's pre-tokenizer regex (tokenization_kimi.py `pat_str`): runs of Han characters, words
# (with English contractions), numbers of up to 3 digits, punctuation runs, whitespace.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000  # the released code encodes a segment in pieces of at most this many characters
MAX_RUN_CHARS = 25_000  # ... and cuts runs of whitespace / non-whitespace longer than this
# Maximal runs of whitespace or of non-whitespace (`\s` is str.isspace, which the released code uses).
_RUN = re.compile(r"\s+|\S+")
# tokenization_kimi.py's additional_special_tokens when tokenizer_config.json names none.
_DEFAULT_ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


def _byte_characters() -> list[str]:
    """GPT-2's byte-to-unicode table, which byte-level BPE vocabularies (and the released
    tokenizer's token strings) write bytes in: the printable Latin-1 bytes as themselves, every
    other byte as the character 256 + its place among those."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARACTERS = _byte_characters()


def read_tiktoken_ranks(file: str) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}. ValueError naming the file (and line) when a line
    is not "<base64> <rank>", or the ranks are not exactly 0..N-1 (the special ids follow N)."""
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{file} line {number}: expected '<base64 token> <rank>', got {line[:80]!r}") from None
    if not ranks:
        raise ValueError(f"{file} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: the ranks of its {len(ranks)} tokens are not 0..{len(ranks) - 1} "
                         "(repeated or missing ranks, or a token listed twice)")
    return ranks


def kimi_special_tokens(num_base_tokens: int, added_tokens_decoder: dict) -> dict[str, int]:
    """{name: id} for the special ids num_base_tokens .. num_base_tokens + 255 (further if
    added_tokens_decoder names higher ids): its names, `<|reserved_token_{id}|>` for the rest."""
    named: dict[int, str] = {}
    for key, entry in added_tokens_decoder.items():
        try:
            token_id, name = int(key), _token_str(entry)
        except (TypeError, ValueError):
            raise ValueError(f"tokenizer_config.json added_tokens_decoder: bad entry {key!r}: {entry!r}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tokenizer_config.json added_tokens_decoder[{key!r}] has no content")
        if token_id < num_base_tokens:
            raise ValueError(f"tokenizer_config.json added_tokens_decoder: id {token_id} ({name!r}) is one of "
                             f"tiktoken.model's {num_base_tokens} base tokens; special ids start at {num_base_tokens}")
        named[token_id] = name
    end = max([num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS] + [i + 1 for i in named])
    specials: dict[str, int] = {}
    for token_id in range(num_base_tokens, end):
        name = named.get(token_id, f"<|reserved_token_{token_id}|>")
        if name in specials:
            raise ValueError(f"tokenizer_config.json: special token {name!r} names both id {specials[name]} "
                             f"and id {token_id}")
        specials[name] = token_id
    return specials


class _TiktokenDecodeStream:
    """IncrementalDecoder over token bytes. A UTF-8 decoder buffers an incomplete trailing
    sequence until the bytes that complete it come (an invalid one becomes U+FFFD at once, as in
    the full decode); while it does, the token's text is held back too and step returns None, as
    `tokenizers`' DecodeStream does, so that the steps concatenate to the full decode."""

    def __init__(self, token_bytes: list[bytes], skipped: frozenset[int], ids: list[int] | None):
        self._token_bytes, self._skipped = token_bytes, skipped
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text returned with the token that completes the character
        for token_id in ids or ():
            self.step(token_id)

    def step(self, token_id: int) -> str | None:
        if token_id in self._skipped or not 0 <= token_id < len(self._token_bytes):
            return None
        self._held += self._utf8.decode(self._token_bytes[token_id])
        if not self._held or self._utf8.getstate()[0]:  # nothing new, or a character is incomplete
            return None
        text, self._held = self._held, ""
        return text


class TiktokenTokenizer(BaseTokenizer):
    """A tiktoken.model tokenizer with its tokenizer_config.json (rules: the module docstring).
    `encoding` is the tiktoken.Encoding (KIMI_PATTERN, the base ranks, the special ids)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], config: dict | None = None,
                 chat_template: str | None = None, name: str = "tiktoken.model"):
        super().__init__(config, chat_template)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = kimi_special_tokens(num_base_tokens, self.config.get("added_tokens_decoder") or {})
        self.encoding = tiktoken.Encoding(name=name, pat_str=KIMI_PATTERN, mergeable_ranks=mergeable_ranks,
                                          special_tokens=self.special_tokens)
        # Every id's bytes (a special token's: its name), for decode_stream and grammar_vocab.
        self._token_bytes = [b""] * self.encoding.n_vocab
        for token, rank in mergeable_ranks.items():
            self._token_bytes[rank] = token
        for token, token_id in self.special_tokens.items():
            self._token_bytes[token_id] = token.encode()
        self._base_ranks = mergeable_ranks
        # tokenization_kimi.py's defaults when tokenizer_config.json has no such key.
        if "bos_token" not in self.config:
            self.bos_token = "[BOS]"
        if "eos_token" not in self.config:
            self.eos_token = "[EOS]"
        self.unk_token = _token_str(self.config.get("unk_token"))
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))
        self._skipped = frozenset(i for i in map(self._id, self._skipped_names()) if i is not None)
        # Longest first: at one position the longest special-token string wins (transformers' trie).
        self._special_re = re.compile("|".join(map(re.escape, sorted(self.special_tokens, key=len, reverse=True))))
        self.pieces = PieceCache()  # the pieces between special tokens of long prompts (hyla.models.piece_cache)

    def _skipped_names(self) -> list[str | None]:
        """The tokens skip_special_tokens drops: transformers' all_special_tokens (the named ones
        and additional_special_tokens, which transformers v5 also reads as extra_special_tokens)."""
        names = [self.bos_token, self.eos_token, self.unk_token, self.pad_token]
        additional, extra = self.config.get("additional_special_tokens"), self.config.get("extra_special_tokens")
        if additional is None and extra is None:
            return names + list(_DEFAULT_ADDITIONAL_SPECIAL_TOKENS)
        for value in (additional, extra):
            if isinstance(value, dict):  # named model-specific tokens: {"image_token": "<image>"}
                value = list(value.values())
            names += [_token_str(v) for v in value or ()]
        return names

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._base_ranks.get(token.encode())

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= MAX_RUN_CHARS:  # nothing to cut: one call does it all in tiktoken
            ids = self.encoding.encode(text, allowed_special="all")
        else:  # the pieces between special tokens, each on its own as tiktoken does; earlier turns' cached
            pieces, specials, start = [], [], 0
            for match in self._special_re.finditer(text):
                pieces.append(text[start:match.start()])
                specials.append(self.special_tokens[match.group()])
                start = match.end()
            pieces.append(text[start:])
            encoded = self.pieces.encode(pieces, lambda texts: [self._encode_ordinary(t) for t in texts])
            ids = list(encoded[0])  # a fresh list: the cache's own sequences are shared
            for special, piece_ids in zip(specials, encoded[1:]):
                ids.append(special)
                ids += piece_ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        """Text without special tokens, in the released code's pieces (module docstring)."""
        ids: list[int] = []
        for chunk_start in range(0, len(text), MAX_ENCODE_CHARS):
            chunk = text[chunk_start:chunk_start + MAX_ENCODE_CHARS]
            cut = 0
            if len(chunk) > MAX_RUN_CHARS:
                for run in _RUN.finditer(chunk):
                    for at in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                        ids += self.encoding.encode_ordinary(chunk[cut:at])
                        cut = at
            ids += self.encoding.encode_ordinary(chunk[cut:])
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        skipped = self._skipped if skip_special_tokens else ()
        n = self.encoding.n_vocab
        return self.encoding.decode([i for i in ids if 0 <= i < n and i not in skipped])

    def convert_ids_to_tokens(self, ids) -> list[str]:
        # a base token's bytes in byte-level characters; a special token's name (its "bytes" here)
        num_base_tokens = len(self._base_ranks)
        return [self._token_bytes[i].decode() if i >= num_base_tokens
                else "".join(_BYTE_CHARACTERS[b] for b in self._token_bytes[i]) for i in map(int, ids)]

    def decode_stream(self, skip_special_tokens: bool = True, ids: list[int] | None = None) -> IncrementalDecoder:
        return _TiktokenDecodeStream(self._token_bytes, self._skipped if skip_special_tokens else frozenset(), ids)

    def grammar_vocab(self) -> tuple[list[bytes], str]:
        # Raw bytes per id (xgrammar's RAW vocabulary takes bytes); b"" for every special id.
        num_base_tokens = len(self._base_ranks)
        return self._token_bytes[:num_base_tokens] + [b""] * (self.vocab_size - num_base_tokens), "RAW"


def load_tiktoken_tokenizer(path: str, config: dict, chat_template: str | None) -> TiktokenTokenizer:
    """The tokenizer of checkpoint directory `path` (tiktoken.model in it), with the directory's
    tokenizer_config.json `config` and chat template. ValueError for a malformed file."""
    file = os.path.join(path, "tiktoken.model")
    return TiktokenTokenizer(read_tiktoken_ranks(file), config, chat_template, name=os.path.basename(file))
