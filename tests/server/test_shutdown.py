"""SIGTERM on a live `hyla serve`: requests still running after --shutdown-drain-s are answered
before the process exits: a stream with an error event and `data: [DONE]`, a whole response
with a 503 body; and the process exits soon after the drain time."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.live import NAME, metric, start

DRAIN_S = 1.0


def test_sigterm_answers_the_requests_the_drain_did_not_finish(model_dir):
    proc, base = start(model_dir, "--shutdown-drain-s", str(DRAIN_S), "--max-model-len", "4096")
    # far longer than the drain time (~20 s of generation at this size)
    body = {"model": NAME, "prompt": "import a", "max_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    got: dict = {}

    def whole():
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        got["whole"] = (r.status_code, r.json())

    def streamed():
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            got["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    calls = [threading.Thread(target=f, daemon=True) for f in (whole, streamed)]
    try:
        for t in calls:
            t.start()
        deadline = time.time() + 30
        while metric(base, "hyla_num_requests_running") < 2:  # both are generating
            assert time.time() < deadline, "the requests did not start"
            time.sleep(0.05)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not exit after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.time() - t0
    for t in calls:
        t.join(timeout=10)
    assert DRAIN_S <= took < DRAIN_S + 6, took
    status, answer = got["whole"]
    assert status == 503 and answer["error"]["code"] == "server_shutting_down", answer
    assert "shutting down" in answer["error"]["message"]
    status, lines = got["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["error"]["code"] == "server_shutting_down"
    assert len(chunks) > 2 and all("choices" in c for c in chunks[:-1])  # tokens streamed before the stop
