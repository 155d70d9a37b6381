"""How the benchmark writes a prompt of a chosen token length.

Three sources, tried in this order by `find_tokenizer`:

1. a local tokenizer (`LocalTokenizer`): the checkpoint `--tokenizer` names, else the served model
   when its name (or the `root` vLLM's /v1/models reports) is a local directory, a bundled hyla
   model or a Hub id already in the Hugging Face cache (nothing is downloaded unless
   `--tokenizer` asks for it);
2. the server's own tokenizer over HTTP (`ServerTokenizer`): vLLM's POST /tokenize and
   /detokenize;
3. none: `PromptMaker` then writes token-id prompts for /v1/completions (ids from
   ANONYMOUS_IDS) and, where text is required (chat), words of WORDS, about one token each.

With a tokenizer a prompt is text whose re-encoding has the target length (`fit_text`, the
decode / re-encode / pad-or-cut loop vLLM's random dataset uses, because N random tokens do not
always decode to a text of N tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

# Ordinary (non-special) tokens in every real vocabulary: special tokens sit in the first few ids
# (Llama-2: 0-2, hyla's default model: 0-3) or after the ordinary ones (GPT-2, Qwen, Llama-3, Kimi).
ANONYMOUS_IDS = range(100, 1100)

# Short common words: one token each in the usual BPE vocabularies (with their leading space).
WORDS = tuple("""
the of and to in is was for on that with as by at from his her this which or had are but be not
have one all were they been their has more its new who other after first into two time when
also only over can would about there some may these such most made city them many state than
world year years school part three then where team used while well during between each under
known both later work days found since name game film long number life area early through
house war best before same several being second last great just high four over small group
music local band based water does around until family way set back place public including
""".split())


class PromptTokenizer(Protocol):
    """What the datasets need of a tokenizer. `name`: where it came from (the result's
    tokenizer_id)."""

    name: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`, with the BOS / EOS the model adds around a text when asked."""

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (special tokens skipped)."""

    def pool(self) -> np.ndarray:
        """The ids random prompts draw from: ordinary tokens, sorted (no special token)."""


class LocalTokenizer:
    """A checkpoint's tokenizer loaded with hyla's loader (tokenizer.json or tiktoken.model)."""

    def __init__(self, directory: str, name: str):
        from hyla.models.tokenizer import load_tokenizer

        self.name = name
        self.tokenizer = load_tokenizer(directory)
        self._pool: np.ndarray | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def pool(self) -> np.ndarray:
        if self._pool is None:
            # grammar_vocab gives "" for a special token that is never text
            texts, _ = self.tokenizer.grammar_vocab()
            special = {self.tokenizer.bos_token_id, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
            self._pool = np.array([i for i, t in enumerate(texts) if t and i not in special], dtype=np.int64)
        return self._pool


class ServerTokenizer:
    """The served model's tokenizer through vLLM's POST /tokenize and /detokenize (hyla's server
    has neither: `probe` then returns None). The pool is the distinct ids of WORDS' text, the only
    ids known to be ordinary tokens without the vocabulary itself."""

    def __init__(self, http: httpx.Client, base_url: str, model: str):
        self.http, self.base_url, self.model = http, base_url, model
        self.name = f"{base_url}/tokenize"
        self._pool: np.ndarray | None = None

    @classmethod
    def probe(cls, http: httpx.Client, base_url: str, model: str) -> ServerTokenizer | None:
        tokenizer = cls(http, base_url, model)
        try:
            tokenizer.encode("hello world")
            tokenizer.decode([1])
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None
        return tokenizer

    def _post(self, path: str, body: dict) -> dict:
        response = self.http.post(self.base_url + path, json={"model": self.model, **body})
        response.raise_for_status()
        return response.json()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tokens = self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]
        if not isinstance(tokens, list):
            raise ValueError("/tokenize did not answer a token list")
        return tokens

    def decode(self, ids: list[int]) -> str:
        prompt = self._post("/detokenize", {"tokens": list(ids)})["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("/detokenize did not answer a text")
        return prompt

    def pool(self) -> np.ndarray:
        if self._pool is None:
            self._pool = np.array(sorted(set(self.encode(" ".join(WORDS)))), dtype=np.int64)
        return self._pool


def local_checkpoint(name: str) -> str | None:
    """The local checkpoint directory `name` stands for, without downloading anything: an
    existing directory, a bundled model's name, or a Hub id already in the cache; else None."""
    from hyla.models.default import BUNDLED_MODELS
    from hyla.models.hub import cached_snapshot, is_repo_id
    from hyla.models.tokenizer import has_tokenizer

    if Path(name).is_dir():
        path = Path(name)
    elif name in BUNDLED_MODELS:
        path = BUNDLED_MODELS[name]
    elif is_repo_id(name):
        path = cached_snapshot(name)
    else:
        return None
    return str(path) if path is not None and has_tokenizer(path) else None


def load_named_tokenizer(name: str) -> LocalTokenizer:
    """`--tokenizer NAME`: a directory, a bundled model or a Hub id (downloaded when missing, as
    the engine does). Raises ValueError naming the problem."""
    from hyla.models.hub import resolve_model

    try:
        return LocalTokenizer(resolve_model(name), name)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {name!r}: {e}") from None


def find_tokenizer(http: httpx.Client, base_url: str, model: str, model_root: str | None,
                   tokenizer: str | None) -> PromptTokenizer | None:
    """The tokenizer the prompts are written with (see the module docstring for the order)."""
    if tokenizer is not None:
        return load_named_tokenizer(tokenizer)
    for name in dict.fromkeys(n for n in (model_root, model) if n):
        directory = local_checkpoint(name)
        if directory is not None:
            return LocalTokenizer(directory, name)
    return ServerTokenizer.probe(http, base_url, model)


def num_special_tokens(tokenizer: PromptTokenizer | None) -> int:
    """How many tokens the tokenizer adds around a text (vLLM's num_special_tokens_to_add)."""
    if tokenizer is None:
        return 0
    return len(tokenizer.encode("a", add_special_tokens=True)) - len(tokenizer.encode("a"))


def fit_text(tokenizer: PromptTokenizer, ids: list[int], target: int, rng: np.random.Generator,
             max_retry: int = 10) -> tuple[str, list[int]]:
    """A text whose encoding is `target` tokens long, written from `ids`: decode, re-encode, cut
    the ids when too long or append random pool ids when too short, up to max_retry times (then
    the last attempt stands). Returns (text, its ids)."""
    pool = tokenizer.pool()
    for _ in range(max_retry):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text)
        if len(ids) == target:
            return text, ids
        ids = ids[:target] if len(ids) > target else ids + pool[rng.integers(0, len(pool), target - len(ids))].tolist()
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text)


class PromptMaker:
    """Prompts of chosen token lengths from random pool ids: text (`text=True`, or whenever there
    is a tokenizer) or token ids.

    pool ids index the tokenizer's vocabulary, ANONYMOUS_IDS (ids, no tokenizer) or WORDS (text,
    no tokenizer: one word per token, an estimate the server's usage corrects)."""

    def __init__(self, tokenizer: PromptTokenizer | None, text: bool):
        self.tokenizer = tokenizer
        self.text = text or tokenizer is not None
        if tokenizer is not None:
            self.pool = tokenizer.pool()
        elif text:
            self.pool = np.arange(len(WORDS))
        else:
            self.pool = np.arange(ANONYMOUS_IDS.start, ANONYMOUS_IDS.stop)
        if len(self.pool) < 2:
            # one id: every random prompt (and every question of prefix / agent) would be the same
            raise ValueError(f"the tokenizer {tokenizer.name!r} gives {len(self.pool)} ordinary token id(s) to write "
                             "prompts with, so every prompt would be the same; pass --tokenizer with the served "
                             "checkpoint's directory")

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.pool[rng.integers(0, len(self.pool), n)].tolist() if n > 0 else []

    def render(self, ids: list[int], rng: np.random.Generator) -> tuple[str | list[int], int]:
        """The prompt made of `ids` (pool ids) and its length in tokens."""
        if not ids:
            return ("" if self.text else []), 0
        if self.tokenizer is not None:
            text, fitted = fit_text(self.tokenizer, ids, len(ids), rng)
            return text, len(fitted)
        if self.text:
            return " ".join(WORDS[i] for i in ids), len(ids)
        return list(ids), len(ids)

    def join(self, first: str | list[int], second: str | list[int]) -> str | list[int]:
        """Two prompts one after the other: token ids or a tokenizer's texts as they are, words
        with a space between."""
        if self.text and self.tokenizer is None and first and second:
            return f"{first} {second}"
        return first + second
