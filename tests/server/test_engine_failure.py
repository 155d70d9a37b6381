"""A failure inside the engine is the server's fault: a 500 with an OpenAI error body, and in a
stream an error event then `[DONE]`; the server keeps serving afterwards."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hyla import LLM
from hyla.server.api import create_app
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


@pytest.fixture(scope="module")
def app_and_engine(tmp_path_factory):
    llm = LLM(str(build_kimi_checkpoint(tmp_path_factory.mktemp("fail"), "dense")), dtype="float32",
              max_model_len=64)
    return create_app(llm.engine, "m"), llm.engine


def test_engine_failure_is_a_500_and_a_stream_error_event(app_and_engine, monkeypatch):
    app, engine = app_and_engine
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
    with TestClient(app) as client:
        real = engine.runner.execute

        def broken(*args, **kwargs):
            raise RuntimeError("device fell over")

        monkeypatch.setattr(engine.runner, "execute", broken)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "device fell over" in err["message"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        monkeypatch.setattr(engine.runner, "execute", real)
        assert client.post("/v1/completions", json=body).status_code == 200
