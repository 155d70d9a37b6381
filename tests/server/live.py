"""Helpers for tests against a live `hyla serve` subprocess (fixtures in conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

MAX_MODEL_LEN = 256
NAME = "kimi-moe-0"
PROMPT = "the cat sat on the mat and the dog"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, *extra) -> tuple[subprocess.Popen, str]:
    """Start `hyla serve` on a free port; returns (process, base URL) once /health answers.

    The port is free when chosen but not held until the server binds it: another process (a
    parallel test worker's server, say) can take it in between, so a start that loses the port
    is retried on a new one."""
    for attempt in range(3):
        try:
            return _start_once(model, extra)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    pass


def _start_once(model, extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hyla.cli", "serve", "--model", str(model), "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--max-body-bytes", "20000", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read()
            if "address already in use" in output.lower():
                raise _PortTaken(f"port {port} was taken before the server bound it:\n{output}")
            raise RuntimeError("server exited:\n" + output)
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
