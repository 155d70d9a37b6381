"""Structured outputs: per-token mask cost of xgrammar (hyla's backend, through
hyla.server.structured.Grammars exactly as the server compiles) vs llguidance, on the bundled
model's tokenizer.

    pip install llguidance   # not a hyla dependency; only this comparison needs it
    python scripts/grammar_bench.py [--repeats 5]

For each spec (json_object, a json_schema, a regex, a choice): compile time (median of
--repeats, caches cleared), then a walk over the tokens of a text the spec accepts: at every step
fill the next-token bitmask (int32 [1, ceil(V / 32)], what the sampler uploads), check that the
walked token is allowed, then advance the matcher by it; EOS must be allowed at the end. Reported:
median and max fill time per token (µs) and the advance time, best of --repeats walks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from types import SimpleNamespace

import torch

from hyla.models import default_model_path
from hyla.models.tokenizer import load_tokenizer
from hyla.server.structured import Grammars, GuideSpec

_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
}
_PERSON = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry", "engines"],
           "address": {"city": "London", "zip": "W1"}, "role": "admin"}
_REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z [A-Z][a-z]+( [a-z]+){2,8}\."
_CHOICES = ["positive", "negative", "neutral", "mixed feelings", "not applicable"]
# (spec, a text it accepts)
CASES = {
    "json_object": (GuideSpec("json_object"), json.dumps({"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22",
                                                          "qty": 1}], "note": "leave at the door", "paid": True})),
    "json_schema": (GuideSpec("json", _SCHEMA), json.dumps(_PERSON)),
    "regex": (GuideSpec("regex", _REGEX), "2026-12-01T16:45:00Z Deliver the parcel to the front door."),
    "choice": (GuideSpec("choice", _CHOICES), "mixed feelings"),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int, eos: int):
        import xgrammar as xgr

        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _dist_version("xgrammar")
        self.grammars = Grammars(SimpleNamespace(tokenizer=tok, vocab_size=vocab_size, eos_token_id=eos))
        self.compiler = self.grammars._get_compiler()

    def compile(self, spec: GuideSpec):
        self.compiler.clear_cache()  # measure a compile, not a cache hit
        return self.grammars.compile(spec)

    def matcher(self, compiled):
        return compiled.matcher()

    def fill(self, m, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int, eos: int):
        import llguidance as llg

        self.llg, self.version = llg, _dist_version("llguidance")
        self.tokenizer = llg.LLTokenizer(tok.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)

    def compile(self, spec: GuideSpec):
        llg = self.llg
        if spec.kind in ("json", "json_object"):
            schema = spec.value if spec.kind == "json" else {"type": "object"}
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        elif spec.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec.value)
        else:  # choice: a Lark alternation of string literals (ASCII choices: json.dumps quotes them as Lark does)
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)  # building the matcher is the compile
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled):
        return compiled[1].deep_copy()  # what a request would get from a compiled grammar

    def fill(self, m, mask: torch.Tensor) -> None:
        v = mask[0]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def walk(backend, compiled, ids: list[int], eos: int, words: int) -> tuple[list[float], list[float]]:
    """-> (fill µs per step, advance µs per step) over ids then EOS."""
    m = backend.matcher(compiled)
    mask = torch.full((1, words), -1, dtype=torch.int32)
    fills, advances = [], []
    for token in ids + [eos]:
        t0 = time.perf_counter()
        backend.fill(m, mask)
        t1 = time.perf_counter()
        assert _allowed(mask, token), f"{backend.name}: token {token} not allowed after {len(fills)} steps"
        ok = backend.advance(m, token)
        t2 = time.perf_counter()
        assert ok, f"{backend.name}: token {token} refused"
        fills.append((t1 - t0) * 1e6)
        advances.append((t2 - t1) * 1e6)
    return fills, advances


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    vocab_size, eos = tok.vocab_size, tok.eos_token_id
    words = (vocab_size + 31) // 32
    backends = [XGrammar(tok, vocab_size, eos), LLGuidance(tok, vocab_size, eos)]
    print(f"vocab {vocab_size}; torch {torch.__version__}, Python {platform.python_version()}; "
          + ", ".join(f"{b.name} {b.version}" for b in backends))
    print(f"{'spec':12} {'backend':11} {'tokens':>6} {'compile ms':>10} {'fill µs p50':>11} {'fill µs mean':>12} "
          f"{'fill µs max':>11} {'advance µs p50':>14}")
    for name, (spec, text) in CASES.items():
        ids = tok.encode(text, add_special_tokens=False)
        for b in backends:
            compile_ms = statistics.median(_timed(b.compile, spec) for _ in range(args.repeats)) * 1e3
            compiled = b.compile(spec)
            runs = [walk(b, compiled, ids, eos, words) for _ in range(args.repeats)]
            fills, advances = min(runs, key=lambda r: sum(r[0]))  # the least disturbed walk
            print(f"{name:12} {b.name:11} {len(ids) + 1:6d} {compile_ms:10.2f} {statistics.median(fills):11.1f} "
                  f"{statistics.mean(fills):12.1f} {max(fills):11.1f} {statistics.median(advances):14.1f}")


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
