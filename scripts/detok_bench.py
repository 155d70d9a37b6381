"""Incremental detokenisation: the hand-written offsets decoder (hyla's before DecodeStream) vs
`tokenizers.decoders.DecodeStream`, on the bundled model's tokenizer.

    python scripts/detok_bench.py [--tokens 4000] [--repeats 5]

Per-token cost (µs, best of --repeats runs over the whole stream) and exactness: after every
token whose full decode is complete (no trailing U+FFFD), the concatenated increments must equal
tokenizer.decode(all ids so far). Streams: hyla's own Python source (code, the realistic case),
multilingual prose (multi-byte UTF-8 split across byte-level tokens), and random ids with special
tokens mixed in (lone bytes that never complete), each with skip_special_tokens on and off.
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib
import platform
import random
import time

import tokenizers
from tokenizers.decoders import DecodeStream

from hyla.models import default_model_path
from hyla.models.tokenizer import load_tokenizer

_PROSE = ("Grüße aus Köln — naïve café, 日本語のテキスト, 中文文本, 한국어, Ελληνικά, русский текст, "
          "emoji 🙂🚀👩‍💻, maths ∑∫√∞≈≠, and quotes «» „“ ‘’.\n")


class HandWritten:
    """The offsets decoder hyla's Sequence used (TGI / vLLM style): decode the new tokens with
    the ones before them and cut off what those give alone; hold back a trailing U+FFFD."""

    def __init__(self, tok, skip: bool):
        self.tok, self.skip, self.ids, self.prefix, self.read = tok, skip, [], 0, 0

    def step(self, token: int) -> str | None:
        ids = self.ids
        ids.append(token)
        prefix = self.tok.decode(ids[self.prefix:self.read], skip_special_tokens=self.skip)
        full = self.tok.decode(ids[self.prefix:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(ids)
            return full[len(prefix):]
        return None


class Stream:
    """tokenizers' own incremental decoder (Rust)."""

    def __init__(self, tok, skip: bool):
        self.tok, self.stream = tok, DecodeStream(skip_special_tokens=skip)

    def step(self, token: int) -> str | None:
        return self.stream.step(self.tok, token)


def streams(tok, n: int) -> dict[str, list[int]]:
    root = os.path.join(os.path.dirname(__file__), "..", "hyla")
    files = sorted(glob.glob(f"{root}/**/*.py", recursive=True))
    code = "".join(pathlib.Path(f).read_text(encoding="utf-8") for f in files)
    rng = random.Random(0)
    specials = [0, 1, 2, 3]  # the bundled tokenizer's special tokens
    rand = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.get_vocab_size()) for _ in range(n)]
    return {"code": tok.encode(code).ids[:n], "prose": tok.encode(_PROSE * (n // 20)).ids[:n], "random": rand}


def exact(cls, tok, ids: list[int], skip: bool) -> tuple[int, int]:
    """-> (positions compared, mismatches)."""
    d, text, compared, bad = cls(tok, skip), "", 0, 0
    for i, t in enumerate(ids):
        try:
            text += d.step(t) or ""
        except Exception:  # noqa: BLE001 - a decoder that raises is counted as wrong at that position
            d, text = cls(tok, skip), tok.decode(ids[: i + 1], skip_special_tokens=skip)  # restart past it
            bad += 1
            continue
        full = tok.decode(ids[: i + 1], skip_special_tokens=skip)
        if not full.endswith("\ufffd"):
            compared += 1
            bad += text != full
    return compared, bad


def per_token_us(cls, tok, ids: list[int], skip: bool, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        d = cls(tok, skip)
        t0 = time.perf_counter()
        for t in ids:
            d.step(t)
        best = min(best, time.perf_counter() - t0)
    return best / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path()).tokenizer
    print(f"tokenizers {tokenizers.__version__}, Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(f"{'stream':8} {'skip':5} {'decoder':11} {'µs/token':>9} {'compared':>9} {'mismatch':>9}")
    for name, ids in streams(tok, args.tokens).items():
        for skip in (True, False):
            us = {c: per_token_us(c, tok, ids, skip, args.repeats) for c in (HandWritten, Stream)}
            for cls in (HandWritten, Stream):
                compared, bad = exact(cls, tok, ids, skip)
                print(f"{name:8} {skip!s:5} {cls.__name__:11} {us[cls]:9.2f} {compared:9d} {bad:9d}")
            print(f"{'':14} DecodeStream / hand-written: {us[Stream] / us[HandWritten]:.2f}x")


if __name__ == "__main__":
    main()
