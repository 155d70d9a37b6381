"""A bounded schemathesis run over the server's own OpenAPI document: bodies generated from the
published request schemas (hyla.server.openapi), on the bundled model, derandomised. No 5xx on
any generated case; every response is the documented JSON (errors carry a message)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")

from hyla import LLM  # noqa: E402
from hyla.models import default_model_path  # noqa: E402
from hyla.server.api import create_app  # noqa: E402


@pytest.fixture(scope="module")
def api_schema():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLM(default_model_path(), dtype="float32", max_model_len=48).engine  # bounds every case's work
    app = create_app(engine, "m", tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    torch.set_num_threads(threads)


def test_generation_bodies_are_published(api_schema):
    """The generation routes document their bodies (without them the fuzz below tests nothing)."""
    raw = api_schema.raw_schema["paths"]
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = raw[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert required in body["required"] and "temperature" in body["properties"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_bodies_never_5xx(api_schema, path):
    """Cases drawn from the operation's schemathesis strategy (the pytest plugin's per-operation
    parametrisation, without the plugin), called on the ASGI app."""
    operation = api_schema[path]["POST"]

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        check(data.draw(operation.as_strategy()))

    run()


def check(case) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = max(1, min(case.body["max_tokens"], 4))  # a bounded amount of decoding
    response = case.call()
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
