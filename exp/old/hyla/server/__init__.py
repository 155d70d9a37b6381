"""hyla.server: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

from hyla.server.api import create_app

__all__ = ["create_app"]
