"""Tokenizer of an HF checkpoint: tokenizer.json (the `tokenizers` library) + tokenizer_config.json.

The chat template is kept (from tokenizer_config.json's `chat_template`, or chat_template.jinja /
chat_template.json next to it) for the server; rendering it needs jinja2 (the `serve` extra),
imported only when `apply_chat_template` is called.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


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


class Tokenizer:
    """encode / decode, special tokens, and the chat template of a checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.config = config or {}
        self.chat_template = chat_template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

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
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs):
        """Render `messages` with the checkpoint's template (jinja2, as transformers does).
        Returns the prompt string, or its token ids when tokenize=True."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json `chat_template`)")
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError("rendering chat templates needs jinja2: pip install 'hyla[serve]'") from err

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs,
        )
        # The template already places BOS etc.; do not add them a second time.
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path) -> Tokenizer:
    """Load `path`/tokenizer.json (required) with `path`/tokenizer_config.json (optional)."""
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        others = [n for n in ("tiktoken.model", "tokenizer.model") if os.path.isfile(os.path.join(path, n))]
        hint = f" (found {others}: only the `tokenizers` format tokenizer.json is supported)" if others else ""
        raise ValueError(f"no tokenizer.json in {path}{hint}")
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    return Tokenizer(_HFTokenizer.from_file(file), config, _chat_template(path, config))
