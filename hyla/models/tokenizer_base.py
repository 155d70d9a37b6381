"""What every tokenizer format gives the rest of hyla (`BaseTokenizer`): encode / decode,
`decode_stream` (incremental detokenisation), `grammar_vocab` (the vocabulary for xgrammar),
the special tokens and the chat template; and the tokenizer_config.json helpers both formats
read. The formats: hyla.models.tokenizer (tokenizer.json) and hyla.models.tiktoken_tokenizer
(Kimi's tiktoken.model); hyla.models.tokenizer.load_tokenizer picks one.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Protocol


def _token_str(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(path: str, config: dict) -> str | None:
    template = config.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if template is None:
        template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


class IncrementalDecoder(Protocol):
    """Text of a token stream, one token at a time (what `BaseTokenizer.decode_stream` returns)."""

    def step(self, token_id: int) -> str | None:
        """The text `token_id` adds after the tokens before it; None while the text so far ends
        in an incomplete UTF-8 sequence (the token that completes it returns all of it)."""


class BaseTokenizer(abc.ABC):
    """What hyla needs of a checkpoint's tokenizer, whatever its file format: the special tokens
    and chat template (tokenizer_config.json), here; encode / decode / decode_stream /
    grammar_vocab / vocab_size / _id in each format's subclass."""

    def __init__(self, config: dict | None = None, chat_template: str | None = None):
        self.config = config or {}
        self.chat_template = chat_template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))

    @abc.abstractmethod
    def _id(self, token: str | None) -> int | None:
        """The id of a special token's string (None for None or an unknown one)."""
        raise NotImplementedError

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, special ones included (may differ from the model's)."""
        raise NotImplementedError

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, special-token strings in it becoming their ids; add_special_tokens:
        with the BOS / EOS the checkpoint's tokenizer adds around a text (if any)."""
        raise NotImplementedError

    @abc.abstractmethod
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids` (a sequence of ints); an incomplete UTF-8 sequence shows as U+FFFD."""
        raise NotImplementedError

    @abc.abstractmethod
    def convert_ids_to_tokens(self, ids) -> list[str]:
        """Each id's entry in the vocabulary, as transformers' convert_ids_to_tokens gives it (a
        byte-level BPE piece in its byte-to-unicode characters, e.g. "Ġthe"; a special token's
        name): what vLLM's /tokenize returns as token_strs."""
        raise NotImplementedError

    @abc.abstractmethod
    def decode_stream(self, skip_special_tokens: bool = True, ids: list[int] | None = None) -> IncrementalDecoder:
        """An incremental decoder whose steps concatenate to `decode(all ids)`; `ids`: tokens
        already decoded (their text is not returned again, but later tokens see them)."""
        raise NotImplementedError

    @abc.abstractmethod
    def grammar_vocab(self) -> tuple[list[str] | list[bytes], str]:
        """(the text of every id, "" for a special token that is never text; the name of the
        xgrammar VocabType those texts are written in: "RAW", "BYTE_LEVEL" or "BYTE_FALLBACK")."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, continue_final_message: bool | str = False,
                            chat_template: str | None = None, **kwargs):
        """Render `messages` with the checkpoint's template, or `chat_template` (a template's
        text) in its place, exactly as transformers does (hyla.models.chat_template; kwargs:
        tools, documents and the template's own variables). Returns the prompt string, or its
        token ids when tokenize=True."""
        from hyla.models.chat_template import render_chat_template, special_tokens

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json `chat_template`)")
        text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    **{**special_tokens(self.config), **kwargs})
        # The template already places BOS etc.; do not add them a second time.
        return self.encode(text, add_special_tokens=False) if tokenize else text
