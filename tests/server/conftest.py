"""Fixtures: the tiny Kimi checkpoint with a word-level tokenizer, served once per test module."""

import openai
import pytest

from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.server.live import start, stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("serve"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = start(model_dir)
    yield base
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
