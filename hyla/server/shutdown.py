"""Serving with a drain: how `hyla serve` stops on SIGTERM / Ctrl-C.

The server stops accepting connections and lets the requests in flight finish for up to
drain_s seconds. Then every request still running is stopped (AsyncEngine.stop_all) and
answered before the process exits: a stream with an error event and `data: [DONE]`, a whole
response with a 503 (hyla.server.generate). uvicorn's own graceful timeout is drain_s plus
ANSWER_S, the time the handlers get to write those answers; past it uvicorn cancels what is
left. A second signal exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

ANSWER_S = 5.0  # after the drain: time the handlers have to send their final answers


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose shutdown stops the AsyncEngine's requests once drain_s has passed."""

    def __init__(self, config: uvicorn.Config, async_engine, drain_s: float):
        super().__init__(config)
        self.async_engine, self.drain_s = async_engine, drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_s, self.async_engine.stop_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(app, host: str, port: int, drain_s: float) -> None:
    """Run `app` (hyla.server.create_app's) until a signal, then drain (module docstring)."""
    if drain_s < 0:
        raise ValueError(f"the drain time must be >= 0 seconds, got {drain_s}")
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_s + ANSWER_S)
    DrainingServer(config, app.state.server.async_engine, drain_s).run()
