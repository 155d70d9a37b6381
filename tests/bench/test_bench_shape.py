"""`hyla bench shape`: a named shape's config.json and synthetic tokenizer, served by `hyla serve
--load-format dummy` and loaded by `hyla bench serve` (prompts of exact token lengths), and the
tokenizer of a released shape's whole vocabulary."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hyla.bench.__main__ import main as bench_main
from hyla.bench.serve import main as serve_bench
from hyla.bench.serve.tokens import LocalTokenizer, fit_text, num_special_tokens
from hyla.bench.shape import main as shape_main
from hyla.models.presets import random_config_dict
from tests.server.live import start, stop

QUIET = ["--disable-tqdm", "--seed", "3"]


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    return shape_main([str(tmp_path_factory.mktemp("shape") / "tiny"), "--random-config", "tiny"])


@pytest.fixture(scope="module")
def server(shape_dir):
    proc, base = start(shape_dir, "--load-format", "dummy", "--device", "cpu")
    yield base
    stop(proc)


def test_served_shape_gets_prompts_of_the_asked_lengths(shape_dir, server):
    assert json.loads((shape_dir / "config.json").read_text()) == random_config_dict("tiny")
    r = serve_bench(["--base-url", server, *QUIET, "--tokenizer", str(shape_dir), "--random-input-len", "24",
                     "--random-output-len", "3", "--num-prompts", "4"])
    assert (r["completed"], r["failed"], r["tokenizer_id"], r["model_id"]) == (4, 0, str(shape_dir), "tiny")
    # text prompts, counted by the server: the tokenizer's decode / encode round trip is exact
    assert r["input_lens"] == [24] * 4 and r["output_lens"] == [3] * 4

    tokenizer = LocalTokenizer(str(shape_dir), "tiny")
    a = serve_bench(["--base-url", server, *QUIET, "--tokenizer", str(shape_dir), "--dataset-name", "agent",
                     "--num-sessions", "2", "--turns", "2", "--tool-output-len", "12", "--question-len", "4",
                     "--output-len", "3"])
    assert (a["backend"], a["completed"], a["failed"]) == ("openai-chat", 4, 0)
    turn = 1 + 12 + 4 + 1 + 1  # <|user|> tool output + question <|eos|>, then <|assistant|>
    for first in (0, 2):  # each session's two turns; the second carries the first and its reply
        reply = len(tokenizer.encode(a["generated_texts"][first]))
        assert a["input_lens"][first:first + 2] == [turn, 2 * turn + reply + 1]  # the reply's <|eos|>
        assert 0 < a["output_lens"][first] <= 3


def test_released_vocabulary_tokenizer(tmp_path):
    start_time = time.perf_counter()
    path = shape_main([str(tmp_path / "kimi"), "--random-config", "kimi-linear-48b-a3b", "--layers", "4"])
    assert time.perf_counter() - start_time < 5
    config = json.loads((path / "config.json").read_text())
    assert config == random_config_dict("kimi-linear-48b-a3b", 4)
    assert (path / "tokenizer.json").stat().st_size < 5e6
    tokenizer = LocalTokenizer(str(path), str(path))
    tok = tokenizer.tokenizer
    assert tok.vocab_size == 163840
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163586, 163839)
    assert num_special_tokens(tokenizer) == 0
    pool = tokenizer.pool()
    assert len(pool) == 163840 - 8 and {163584, 163586, 163839}.isdisjoint(pool.tolist())
    rng = np.random.default_rng(0)
    ids = pool[rng.integers(0, len(pool), 300)].tolist()
    text, fitted = fit_text(tokenizer, ids, 300, rng)
    assert fitted == ids and text.startswith(" ")
    half = len(ids) // 2  # texts joined as they are encode to the ids joined
    assert tokenizer.encode(tokenizer.decode(ids[:half]) + tokenizer.decode(ids[half:])) == ids
    prompt = tok.apply_chat_template([{"role": "user", "content": tokenizer.decode(ids[:5])}])
    assert tok.encode(prompt, add_special_tokens=False)[1:6] == ids[:5]
    assert prompt.endswith("<|eos|><|assistant|>")


def test_shape_refuses_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit):
        bench_main(["shape", str(tmp_path), "--random-config", "tiny"])
    assert "holds weights" in capsys.readouterr().err
