"""Structured outputs: a request's response_format / guided_* / structured_outputs fields ->
a compiled grammar (the engine's SamplingParams.guide), through xgrammar (the `grammar` extra).

The engine sees only the Guide / GuideMatcher protocol of hyla.engine.sampling_params: every
sequence gets its own matcher, whose bitmask the sampler applies to that row's logits on the
device. xgrammar is imported on the first structured request, so a server without it still
serves everything else (and answers such a request with a 400 saying what to install).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)


@dataclass(frozen=True)
class GuideSpec:
    """What the output must follow. kind: json (value: a JSON schema, dict), json_object (any
    JSON object), regex (a pattern), choice (value: a list of strings), grammar (EBNF with a
    `root` rule, or Lark), structural_tag (value: xgrammar's structural tag as JSON text, the
    {"format": ...} form or the older {"structures": ..., "triggers": ...} one)."""

    kind: str
    value: object = None


class GuideError(ValueError):
    """The spec does not compile (a bad schema, pattern or grammar) or xgrammar is missing."""


class XGrammarGuide:
    def __init__(self, compiled, stop_token_ids: list[int]):
        self.compiled, self.stop_token_ids = compiled, stop_token_ids

    def matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids)


def _choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ... with each choice as an EBNF string literal."""
    def literal(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def _compile_structural_tag(compiler, text: str):
    """A structural tag (JSON text) -> compiled grammar, as vLLM's xgrammar backend does: the
    older form (structures of begin / schema / end, and the triggers that start them) through
    xgrammar's item list, the format form as it is."""
    import xgrammar as xgr

    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise GuideError(f"the structural tag's structures need begin, schema and end, and triggers: {e}") from None
    return compiler.compile_structural_tag(items, triggers)


class Grammars:
    """Compiles GuideSpecs for one engine (its tokenizer and vocabulary). Thread-safe: requests
    compile in worker threads, so a slow grammar does not stall the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self._compiler = None
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GuideError("structured outputs need xgrammar: pip install 'hyla[grammar]'") from None
                tok = self.engine.tokenizer
                if tok is None:
                    raise GuideError("structured outputs need a tokenizer")
                # One entry per id of the model's vocabulary ("": never text, e.g. the ids the
                # model has past the tokenizer's).
                texts, vocab_type = tok.grammar_vocab()
                size = self.engine.vocab_size
                empty = b"" if texts and isinstance(texts[0], bytes) else ""  # xgrammar: all str or all bytes
                vocab = texts[:size] + [empty] * max(0, size - len(texts))
                stop = list(self.engine.eos_token_ids)  # every id that ends a request
                info = xgr.TokenizerInfo(vocab, xgr.VocabType[vocab_type], vocab_size=size,
                                         stop_token_ids=stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._stop = stop
            return self._compiler

    def compile(self, spec: GuideSpec, any_whitespace: bool = True) -> XGrammarGuide:
        """any_whitespace: JSON may have any whitespace between tokens (vLLM's default); False:
        compact separators only (weak models can otherwise loop on whitespace)."""
        compiler = self._get_compiler()
        with self._compile_lock:  # one compile at a time: the compiler's cache is shared
            return self._compile(compiler, spec, any_whitespace)

    def _compile(self, compiler, spec: GuideSpec, any_whitespace: bool) -> XGrammarGuide:
        try:
            if spec.kind == "json":
                compiled = compiler.compile_json_schema(json.dumps(spec.value), any_whitespace=any_whitespace)
            elif spec.kind == "json_object":  # an object, not any JSON value (as vLLM)
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(_choice_ebnf(list(spec.value)))
            elif spec.kind == "grammar":
                g = spec.value
                compiled = compiler.compile_grammar(g) if "::=" in g else compiler.compile_lark(g)
            elif spec.kind == "structural_tag":
                compiled = _compile_structural_tag(compiler, spec.value)
            else:
                raise GuideError(f"unknown structured output kind {spec.kind!r}")
        except GuideError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for bad input
            reason = _LOG_PREFIX.sub("", str(e)).strip()  # "[12:00:00] /project/cpp/x.cc:94: " is noise
            raise GuideError(f"the {spec.kind} does not compile: {reason}") from None
        return XGrammarGuide(compiled, self._stop)
