"""Encoding time of a growing chat conversation's prompts, each turn's whole prompt as the server
encodes it (hyla.models.piece_cache: the pieces of earlier turns cached) against the whole text
encoded at once, ids checked equal at every turn.

    python scripts/chat_prompt_encode.py [--model PATH] [--turns 30] [--system-words 3000]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from hyla.models import load_tokenizer
from hyla.models.default import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory with a tokenizer (default: the bundled model)")
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--system-words", type=int, default=3000)
    p.add_argument("--user-words", type=int, default=400)
    p.add_argument("--reply-words", type=int, default=100)
    args = p.parse_args()
    tok = load_tokenizer(args.model or default_model_path())
    words = Path(__file__).read_text().split() * 4  # any text: this file's words
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "system", "content": text(args.system_words)}]
    print("turn  tokens  cached ms  whole ms")
    for turn in range(args.turns):
        messages.append({"role": "user", "content": text(args.user_words)})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        began = time.perf_counter()
        ids = tok.encode(prompt, add_special_tokens=False)
        cached = time.perf_counter() - began
        began = time.perf_counter()
        whole = tok.tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids if hasattr(tok, "tokenizer") \
            else tok.encoding.encode(prompt, allowed_special="all")
        whole_s = time.perf_counter() - began
        if ids != whole:
            raise SystemExit(f"turn {turn}: the cached encoding differs from the whole text's")
        print(f"{turn:4d} {len(ids):7d} {cached * 1e3:10.2f} {whole_s * 1e3:9.2f}")
        messages.append({"role": "assistant", "content": text(args.reply_words)})


if __name__ == "__main__":
    main()
