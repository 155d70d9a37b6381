"""Kimi's tiktoken tokenizer format (tiktoken.model + tokenizer_config.json, no tokenizer.json).

The fixture writes a checkpoint-style tokenizer in the released format: a byte-level BPE
tiktoken.model (the 256 bytes plus merges learnt here from a small corpus by greedy pair
merging) and a tokenizer_config.json with Kimi's special ids after the base vocabulary. The
reference is a tiktoken.Encoding built directly from those files with Kimi's released `pat_str`
(as tokenization_kimi.py builds it); the engine and server tests run a tiny random Kimi-Linear
model whose vocabulary is exactly the tokenizer's.
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.models.tiktoken_tokenizer import TiktokenTokenizer
from hyla.models.tokenizer import load_tokenizer

# tokenization_kimi.py's `pat_str`, as released (the oracle for hyla's KIMI_PATTERN).
RELEASED_PAT_STR = "|".join([
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

CORPUS = (
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine; we've DONE it.\n"
    "def encode(text):\n    return [ord(c) for c in text]  # 123 456 7890\n"
    "你好，世界！今天天气很好。我们一起去公园散步吧。中文分词测试。\n"
    "Ünïcödé naïve café — ∑ ∫ √ 🙂👍🏽 日本語のテキスト 한국어 텍스트\n"
    "Call 1234567890 or 0987654321 now; 2024-01-31 at 12:45, pi = 3.14159265.\n"
    "I'm here, you're there, it's late, we'll see, they've gone, he'd know, I'M SURE  \n  \n\t \r\n"
) * 4
NUM_MERGES = 400
# Kimi's named special ids, as offsets from the base vocabulary (tokenizer_config.json of the release).
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
         6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
         14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
         254: "[UNK]", 255: "[PAD]"}
ADDITIONAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
              "[EOT]", "<|im_system|>", "<|im_middle|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def _learn_ranks(corpus: str, num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair, merged,
    num_merges times (any such ranks are a valid tiktoken vocabulary). The pairs are counted in
    the corpus's words and in its whole lines, so that tokens also span what the pre-tokenizer
    regex splits apart: which of them encode uses depends on the regex."""
    ranks = {bytes([b]): b for b in range(256)}
    pieces = re.findall(r" ?\w+| ?[^\w\s]+|\s+", corpus) + corpus.splitlines(keepends=True)
    words = [[bytes([b]) for b in w.encode()] for w in pieces]
    for _ in range(num_merges):
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def write_tiktoken_tokenizer(path: Path, omit: tuple[int, ...] = (5,)) -> int:
    """Write tiktoken.model + tokenizer_config.json (all 256 special ids listed, except the
    offsets in `omit`, which then take their default names); returns the base vocabulary size."""
    import base64

    ranks = _learn_ranks(CORPUS, NUM_MERGES)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in by_rank]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    added = {str(n + k): {"content": NAMED.get(k, f"<|reserved_token_{n + k}|>"), "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False, "special": True}
             for k in range(256) if k not in omit}
    config = {"added_tokens_decoder": added, "additional_special_tokens": ADDITIONAL, "bos_token": "[BOS]",
              "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]", "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
              "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return n


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kimi-tiktoken")
    write_tiktoken_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir) -> TiktokenTokenizer:
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def ref(tok_dir) -> tiktoken.Encoding:
    """What tokenization_kimi.py builds from the same files (tiktoken's own reader, uncached)."""
    from tiktoken.load import load_tiktoken_bpe

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # "" = read the file, write no cache copy
        ranks = load_tiktoken_bpe(str(tok_dir / "tiktoken.model"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    names = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("ref", pat_str=RELEASED_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def _n(tok) -> int:
    return tok.vocab_size - 256  # the base vocabulary size


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've DONE it. You'RE right, he'D know.",
    "你好，世界！今天天气很好。",
    "GPT-4o 模型在 2024 年发布，价格是 3.14159 元。",
    "1234567890 12 345 6789 000",
    "!!!???...;;; --- *** ((( ))) [[[ ]]]",
    "🙂👍🏽🇫🇷 emoji 🙂 and ZWJ 👨‍👩‍👧",
    "a  b   c\t\td\n\ne \r\n f      \n   \n",
    "    indented\n        more\n\n\n",
    "It is done.\nNext line.\n",
    "I'M SURE  \n  \n\t \r\nnext",
    "def f(x):\n    return x ** 2  # square\n",
    "e\u0301 combining, Ünïcödé naïve café, 日本語のテキスト, 한국어 텍스트, Ελληνικά, русский",
    "<|im_user|>user<|im_middle|>hi there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
    "not special: <|im_end <im_end|> [BOS <|reserved_token_|> <|tool_call_begin |>",
    "",
    " ",
    "\n",
]


# ---- encode ---------------------------------------------------------------------------------

def test_the_released_files_load_as_kimis_tokenizer(tok, tok_dir):
    n = _n(tok)
    assert isinstance(tok, TiktokenTokenizer) and not (tok_dir / "tokenizer.json").exists()
    assert tok.vocab_size == n + 256 and 256 + 300 < n <= 256 + NUM_MERGES  # merges until the corpus is whole words
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 1, n + 255)
    assert tok.special_tokens["<|im_end|>"] == n + 2 and tok.special_tokens["<|tool_call_end|>"] == n + 15
    assert tok.special_tokens[f"<|reserved_token_{n + 5}|>"] == n + 5  # not listed: its default name
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_tiktoken_with_kimis_pattern(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")  # special strings in text become their ids
    assert tok.encode(text, add_special_tokens=False) == ids  # the released tokenizer adds no BOS
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_the_vocabulary_splits_characters_over_tokens(tok, ref):
    """The decode tests below mean something only if some tokens hold part of a character."""
    ids = tok.encode("".join(TEXTS))
    partial = [i for i in ids if i < _n(tok)]
    assert any(not _is_utf8(ref.decode_single_token_bytes(i)) for i in partial)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=60)
       | st.lists(st.sampled_from(["<|im_end|>", "[BOS]", "你好", " ", "\n", "a", "'s", "1", "🙂", "é"]),
                  max_size=20).map("".join))
def test_encode_equals_tiktoken_on_random_text(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_long_text_is_encoded_in_the_released_pieces(tok, ref):
    """Over 25,000 characters: runs longer than that are cut every 25,000 characters and a
    segment is encoded 400,000 characters at a time; text without such runs is unchanged."""
    words = "the 你好 fox, 123 <|im_end|> jumps\n" * 1000  # > 25,000 characters, short runs
    assert len(words) > 25_000 and tok.encode(words) == ref.encode(words, allowed_special="all")
    run = "a" + "he" * 15_000  # one 30,001-character non-whitespace run, cut inside a "he" token
    text = "x " + run + "  <|im_end|>" + " " * 26_000 + "y"
    expected = (ref.encode("x " + run[:25_000]) + ref.encode(run[25_000:] + "  ")
                + [tok.special_tokens["<|im_end|>"]] + ref.encode(" " * 25_000) + ref.encode(" " * 1_000 + "y"))
    assert tok.encode(text) == expected != ref.encode(text, allowed_special="all")
    big = " quick" * 75_000  # 450,000 characters: two pieces, cut inside a " quick" token
    assert tok.encode(big) == ref.encode(big[:400_000]) + ref.encode(big[400_000:]) != ref.encode(big)


def test_a_growing_conversation_reuses_its_earlier_pieces(tok_dir, ref):
    """Long prompts' pieces between special tokens are kept (hyla.models.piece_cache): the next
    turn's prompt encodes only its new pieces, to the same ids as the whole text."""
    tok = load_tokenizer(tok_dir)  # a cache of its own
    history = "<|im_system|>system<|im_middle|>" + "You are a careful agent. 你好 " * 1200 + "<|im_end|>"
    for turn in range(3):
        history += f"<|im_user|>user<|im_middle|>{'tool output %d, ' % turn * 300} é<|im_end|>"
        prompt = history + "<|im_assistant|>assistant<|im_middle|>"
        assert len(prompt) > 25_000 and tok.encode(prompt, add_special_tokens=False) == ref.encode(
            prompt, allowed_special="all")
        history += "<|im_assistant|>assistant<|im_middle|>" + "an answer " * 50 + "<|im_end|>"
    assert tok.pieces.hits >= 4 and tok.pieces.misses >= 4


def test_add_bos_token_in_the_config_adds_bos(tok_dir, tmp_path):
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    with_bos = load_tokenizer(tmp_path)
    assert with_bos.encode("hi") == [with_bos.bos_token_id] + with_bos.encode("hi", add_special_tokens=False)
    assert with_bos.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)[0] != with_bos.bos_token_id


# ---- decode -------------------------------------------------------------------------------

def test_skip_special_tokens_drops_transformers_special_ids_only(tok):
    """skip_special_tokens drops bos / eos / unk / pad and additional_special_tokens (transformers'
    all_special_ids for the released tokenizer); tool-call markers and reserved ids stay."""
    n = _n(tok)
    text = (f"[BOS]<|im_user|>hi<|im_middle|>你好<|im_end|><|tool_calls_section_begin|>x"
            f"<|reserved_token_{n + 100}|>[UNK][PAD][EOT][EOS]")
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == f"hi你好<|tool_calls_section_begin|>x<|reserved_token_{n + 100}|>"
    assert tok.decode(ids + [tok.vocab_size, 10**9]) == tok.decode(ids)  # unknown ids: no text


def test_decode_of_a_split_character_is_replaced_then_completed(tok, ref):
    ids = tok.encode("日本語🙂")
    cut = next(k for k in range(1, len(ids)) if not _is_utf8(b"".join(map(ref.decode_single_token_bytes, ids[:k]))))
    assert tok.decode(ids[:cut]).endswith("\ufffd")
    assert tok.decode(ids) == "日本語🙂"


# ---- incremental decode ---------------------------------------------------------------------

def _stream_text(tok, ids, skip, primed=None):
    stream = tok.decode_stream(skip, ids=primed)
    return [stream.step(i) for i in ids]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_equals_decode_at_every_complete_prefix(tok, skip):
    ids = tok.encode("".join(TEXTS))
    steps = _stream_text(tok, ids, skip)
    checked = 0
    for k in range(len(ids) + 1):
        full = tok.decode(ids[:k], skip_special_tokens=skip)
        text = "".join(s or "" for s in steps[:k])
        if full.endswith("\ufffd"):
            assert steps[k - 1] is None  # held back: a character is incomplete
            assert full.startswith(text)
        else:
            assert text == full
            checked += 1
    assert checked > len(ids) // 2
    assert "".join(s or "" for s in steps) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_on_random_ids(tok, skip):
    """Random ids (lone bytes of multi-byte characters, invalid sequences, special ids, ids past
    the vocabulary): the stream's text is the full decode whenever that one is complete."""
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size + 3) for _ in range(40)]
        stream, text = tok.decode_stream(skip), ""
        for k, i in enumerate(ids, 1):
            text += stream.step(i) or ""
            full = tok.decode(ids[:k], skip_special_tokens=skip)
            if not full.endswith("\ufffd"):
                assert text == full


def test_a_primed_stream_continues_after_its_ids(tok):
    ids = tok.encode("日本語のテキスト 🙂 한국어")
    for cut in range(len(ids)):
        head = tok.decode(ids[:cut]).rstrip("\ufffd")
        rest = "".join(s or "" for s in _stream_text(tok, ids[cut:], True, primed=ids[:cut]))
        assert head + rest == tok.decode(ids)


# ---- chat template and grammar vocabulary ---------------------------------------------------

def test_chat_template_renders_and_encodes_the_markers_as_special_ids(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>你好<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(text) and ids.count(tok.special_tokens["<|im_end|>"]) == 2


def test_grammar_vocab_is_raw_bytes_with_no_text_for_special_ids(tok, ref):
    vocab, kind = tok.grammar_vocab()
    n = _n(tok)
    assert kind == "RAW" and len(vocab) == tok.vocab_size
    assert vocab[:n] == [ref.decode_single_token_bytes(i) for i in range(n)]
    assert vocab[n:] == [b""] * 256


# ---- bad files --------------------------------------------------------------------------------

@pytest.mark.parametrize("content,match", [
    ("", "holds no tokens"),
    ("YQ== 0\nYg== 2\n", "ranks .* are not 0..1"),
    ("YQ== 0\nnot-base64! 1\n", "line 2: expected '<base64 token> <rank>'"),
    ("YQ==\n", "line 1"),
])
def test_a_malformed_tiktoken_model_is_a_value_error(tmp_path, content, match):
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tmp_path)


def test_a_special_id_inside_the_base_vocabulary_is_a_value_error(tok_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"3": {"content": "[X]"}}}))
    with pytest.raises(ValueError, match="id 3 .*'\\[X\\]'.* base tokens"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_wins_over_tiktoken_model(tok_dir, tmp_path):
    from tokenizers import Tokenizer, models

    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert not isinstance(load_tokenizer(tmp_path), TiktokenTokenizer)


# ---- engine and server end to end -----------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tok_dir, tok):
    """A tiny random Kimi-Linear checkpoint whose vocabulary is the tokenizer's (as Kimi's
    163840 = 163584 + 256), with the tiktoken files beside it and no tokenizer.json."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from hyla import LLM
    from tests.oracles.kimi_checkpoint import TINY, VARIANTS

    path = tok_dir / "model"
    ids = dict(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    KimiLinearForCausalLM(KimiLinearConfig(**{**TINY, **ids}, **VARIANTS["dense"])).eval().save_pretrained(path)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (path / name).write_bytes((tok_dir / name).read_bytes())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(path), dtype="float32", max_model_len=256)
    torch.set_num_threads(threads)


PROMPTS = ["你好，世界！", "The quick brown fox<|im_end|>", "def f(x):\n    return"]


@pytest.mark.parametrize("skip", [True, False])
def test_engine_text_prompts_and_output_text(llm, tok, skip):
    from hyla import SamplingParams

    assert isinstance(llm.engine.tokenizer, TiktokenTokenizer)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                skip_special_tokens=skip), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == tok.encode(prompt)
        ids = out.outputs[0].token_ids
        assert len(ids) == 24
        # (the stream holds back a character whose last bytes have not come; decode shows U+FFFD)
        assert out.outputs[0].text.rstrip("\ufffd") == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


def test_engine_stop_strings_cut_the_tiktoken_text(llm, tok):
    from hyla import SamplingParams

    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, free):
        text = out.outputs[0].text
        # A visible two-character stop string from the middle of the free text on.
        stop = next(text[k:k + 2] for k in range(len(text) // 2, len(text) - 1)
                    if text[k:k + 2].isprintable() and not text[k:k + 2].isspace() and "\ufffd" not in text[k:k + 2])
        cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


def test_streamed_chat_equals_the_whole_answer_and_json_object_output(llm, tok):
    pytest.importorskip("xgrammar")
    from fastapi.testclient import TestClient

    from hyla.server.api import create_app

    body = {"model": "m", "messages": [{"role": "user", "content": "说点什么 🙂"}], "max_tokens": 20,
            "temperature": 0, "ignore_eos": True}
    with TestClient(create_app(llm.engine, "m")) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        deltas = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        deltas.append(choice["delta"].get("content") or "")
        assert "".join(deltas) == whole and whole
        schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["是", "no"]}},
                  "required": ["answer"], "additionalProperties": False}
        r = http.post("/v1/chat/completions", json={
            **body, "ignore_eos": False, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            "structured_outputs": {"disable_any_whitespace": True}})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"])["answer"] in ("是", "no")


def test_json_object_grammar_compiles_with_the_tiktoken_vocabulary(llm, tok):
    pytest.importorskip("xgrammar")
    from hyla.server.structured import Grammars, GuideSpec

    guide = Grammars(llm.engine).compile(GuideSpec("json_object"))
    matcher = guide.matcher()
    for token in tok.encode('{"键": [1, "值 🙂"], "b": {}}'):  # tokens that split characters too
        assert matcher.accept_token(token), token
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()
    assert not guide.matcher().accept_token(tok.encode("[")[0])  # an object, not any value


def test_logprob_tokens_are_each_id_decoded_alone_special_tokens_included(tok):
    """vLLM's logprob token strings: tokenizer.decode([id]) with its default, which keeps special
    tokens (a skipped one would be an empty string); a lone byte of a character is U+FFFD."""
    from hyla.engine.outputs import CompletionOutput
    from hyla.server.logprobs import chat_logprobs, completion_logprobs

    (the,), lone, im_end = tok.encode(" the"), 0x80, tok.special_tokens["<|im_end|>"]  # 0x80: a lone byte
    c = CompletionOutput(0, "", [the, lone, im_end], logprobs=[{the: -0.1}, {lone: -0.2}, {im_end: -0.3, the: -1.0}])
    assert completion_logprobs(tok, c, 0, 1)["tokens"] == [" the", "\ufffd", "<|im_end|>"]
    top = chat_logprobs(tok, c, 2, 1)["content"][0]["top_logprobs"]
    assert [t["token"] for t in top] == ["<|im_end|>"] and top[0]["bytes"] == list(b"<|im_end|>")
