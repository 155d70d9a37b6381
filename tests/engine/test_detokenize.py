"""Incremental detokenisation (Sequence.check_stop): after every token the text equals a full
decode of the output so far, whenever that decode is complete (does not end in a partial UTF-8
sequence), for random token streams that split multi-byte characters and contain special tokens."""

import random

import pytest

from hyla.engine.sampling_params import SamplingParams
from hyla.engine.sequence import Sequence
from hyla.models import default_model_path
from hyla.models.tokenizer import Tokenizer, load_tokenizer


class _Metaspace:
    """A SentencePiece-style tokenizer (Metaspace: "▁" marks a space, the decoder drops the space
    before the first token), trained here on a few lines: decoding new tokens without their left
    context would lose the spaces between them, which the byte-level tokenizer never shows."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        lines = ["def f(x): return héllo wörld café naïve 日本語 🙂 x + y", "the quick brown fox jumps"] * 20
        tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
        self.tokenizer = tok  # the name hyla's Tokenizer gives its `tokenizers` one (DecodeStream reads it)
        self.bos_token_id, self.eos_token_id = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens=True, ids=None):
        return Tokenizer(self.tokenizer).decode_stream(skip_special_tokens, ids)


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request):
    return load_tokenizer(default_model_path()) if request.param == "byte-level" else _Metaspace()


def _stream(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Pieces of real text with non-ASCII characters, random ids and special tokens mixed in."""
    text = "def f(x):\n    return 'héllo wörld — ∑ 日本語 🙂' + x  # naïve café\n"
    ids = tokenizer.encode(text * 3)
    special = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.6:
            start = rng.randrange(len(ids))
            out += ids[start:start + rng.randint(1, 6)]
        elif r < 0.9:
            out.append(rng.randrange(tokenizer.vocab_size))  # includes lone bytes of multi-byte chars
        elif special:
            out.append(rng.choice(special))
    return out[:n]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_full_decode(tokenizer, skip_special_tokens, seed):
    rng = random.Random(seed)
    ids = _stream(tokenizer, rng, 300)
    params = SamplingParams(max_tokens=1000, ignore_eos=True, skip_special_tokens=skip_special_tokens)
    seq = Sequence("r", None, [1, 2, 3], params, max_tokens=1000, eos_token_ids=())
    checked = 0
    for t in ids:
        seq.append_token(t, None)
        seq.check_stop(tokenizer)
        full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip_special_tokens)
        if not full.endswith("\ufffd"):
            assert seq.text == full, f"after {len(seq.output_token_ids)} tokens"
            checked += 1
    assert checked > 150  # most positions: the test must not pass by never comparing


def test_a_stop_string_inside_one_long_token_is_found():
    """Issue 21's defect: byte-level BPE merges a newline with the indentation after it (here 33
    spaces), so the stop string "\n" is one character at the front of a 34-character token."""
    tok = load_tokenizer(default_model_path())
    ids = tok.encode("x = 1\n" + " " * 34 + "y", add_special_tokens=False)
    assert any(tok.decode([t]).startswith("\n" + " " * 17) for t in ids)  # the case the bug needs
    params = SamplingParams(max_tokens=12, stop=["\n"])
    seq = Sequence("r", None, [1, 2, 3], params, max_tokens=12, eos_token_ids=())
    for t in ids:
        seq.append_token(t, None)
        seq.check_stop(tok)
        if seq.is_finished:
            break
    assert seq.finish_reason == "stop" and seq.text == "x = 1"


class _FailsOnce:
    """Stands in for the tokenizer's decode_stream, raising as DecodeStream's InvalidPrefix does."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def step(self, token):
        self.calls += 1
        if self.calls == 3:
            raise Exception("DecodeStream failed: InvalidPrefix")  # noqa: TRY002 - what tokenizers raises
        return "?"  # never reached after the failure: the sequence replaces its stream


def test_a_failing_stream_resyncs_to_the_full_decode():
    """A decoder error must not fail the step (check_stop runs outside the engine's guards): the
    text becomes the full decode and later tokens continue from there."""
    tok = load_tokenizer(default_model_path())
    ids = tok.encode("def f(x):\n    return 'héllo' + x\n", add_special_tokens=False)
    seq = Sequence("r", None, [1, 2, 3], SamplingParams(max_tokens=100), max_tokens=100, eos_token_ids=())
    seq._decoder = _FailsOnce(tok)
    for t in ids:
        seq.append_token(t, None)
        seq.check_stop(tok)
    assert seq.text == tok.decode(ids)
