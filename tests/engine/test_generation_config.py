"""generation_config.json and EOS lists: every EOS id ends a request; the file's sampling
defaults apply to requests that leave them unset (LLM and server), unless generation_config="vllm"."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from hyla.engine import LLM, SamplingParams
from hyla.engine.generation_config import read_generation_config
from hyla.server.api import create_app
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

CONFIG_EOS = [2, 5, 7]  # a GLM-style list in config.json
GENERATION_EOS = [9, 5]  # and generation_config.json's own list, overlapping it
DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
            "max_new_tokens": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_kimi_checkpoint(tmp_path_factory.mktemp("gencfg"), "dense", with_tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = CONFIG_EOS
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": GENERATION_EOS, "do_sample": True, "bos_token_id": 1, **DEFAULTS}))
    return path


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype=torch.float32, device="cpu", max_num_seqs=4, max_model_len=64,
               memory_budget=1 << 22, **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return _llm(checkpoint)


def _forced(token: int, **kwargs) -> SamplingParams:
    """Greedy with `token` pushed far above every other: the model emits it every step."""
    return SamplingParams(temperature=0.0, max_tokens=6, logit_bias={token: 100.0}, **kwargs)


def test_every_eos_id_of_config_generation_config_and_tokenizer_ends_a_request(llm):
    tokenizer_eos = llm.tokenizer.eos_token_id
    assert llm.engine.eos_token_ids == tuple(dict.fromkeys(CONFIG_EOS + GENERATION_EOS + [tokenizer_eos]))
    for eos in CONFIG_EOS + GENERATION_EOS:
        c = llm.generate([[3, 4]], _forced(eos))[0].outputs[0]
        assert (c.token_ids, c.finish_reason) == ([eos], "stop"), eos
        c = llm.generate([[3, 4]], _forced(eos, ignore_eos=True))[0].outputs[0]
        assert (len(c.token_ids), c.finish_reason) == (6, "length"), eos
    c = llm.generate([[3, 4]], _forced(11))[0].outputs[0]  # not an EOS id
    assert (c.token_ids, c.finish_reason) == ([11] * 6, "length")
    c = llm.generate([[3, 4]], _forced(11, stop_token_ids=[11]))[0].outputs[0]  # stop_token_ids add to them
    assert (c.token_ids, c.finish_reason) == ([11], "stop")


def test_default_sampling_params_come_from_generation_config(llm):
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.0, 0.8, 20, 0.05, 1.05, 3)
    out = llm.generate([[3, 4, 6]])[0].outputs[0]  # no SamplingParams: the defaults
    assert len(out.token_ids) <= 3
    assert out.token_ids == llm.generate([[3, 4, 6]], p)[0].outputs[0].token_ids


def test_generation_config_vllm_turns_the_defaults_off_but_keeps_the_eos_ids(checkpoint):
    llm = _llm(checkpoint, generation_config="vllm")
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (SamplingParams().temperature, 1.0, 0, SamplingParams().max_tokens)
    assert set(GENERATION_EOS) <= set(llm.engine.eos_token_ids)
    c = llm.generate([[3, 4]], _forced(9))[0].outputs[0]
    assert c.finish_reason == "stop"


def test_generation_config_from_another_directory(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    llm = _llm(checkpoint, generation_config=str(tmp_path))
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p) == (0.3, 7, 1.0)
    assert 9 not in llm.engine.eos_token_ids  # the checkpoint's file is not read then


@pytest.mark.parametrize("body, field", [
    ({"temperature": "hot"}, "temperature"), ({"top_k": 2.5}, "top_k"), ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, True]}, "eos_token_id"), ({"max_new_tokens": float("nan")}, "max_new_tokens"),
])
def test_a_bad_generation_config_is_a_value_error_naming_the_field(tmp_path, body, field):
    (tmp_path / "generation_config.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=field):
        read_generation_config(str(tmp_path))


def test_invalid_defaults_and_bad_modes_fail_at_startup(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json's sampling defaults are invalid: top_p"):
        _llm(checkpoint, generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a directory"):
        _llm(checkpoint, generation_config="hf")
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        read_generation_config(str(tmp_path))


def test_server_applies_the_defaults_to_fields_a_request_leaves_unset(llm):
    seen: list[SamplingParams] = []
    add = llm.engine.add_request

    def spy(request_id, prompt, params=None, prompt_token_ids=None):
        seen.append(params)
        return add(request_id, prompt, params, prompt_token_ids)

    llm.engine.add_request = spy
    try:
        with TestClient(create_app(llm.engine, "m")) as client:
            r = client.post("/v1/completions", json={"prompt": [3, 4], "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3  # max_new_tokens
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "temperature": 0.9, "top_k": 3,
                "max_completion_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        llm.engine.add_request = add
    unset, chat = seen
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty, unset.max_tokens) == (
        0.0, 0.8, 20, 0.05, 1.05, 3)
    assert (chat.temperature, chat.top_k, chat.top_p, chat.max_tokens) == (0.9, 3, 0.8, 5)  # set fields win
