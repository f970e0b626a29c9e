"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an :class:`~cbgen.async_engine.AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with SSE and end with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``.  See ``docs/server.md``.

This module is the package's public face (``build_app``, ``ServerLimits``, ``main``); the work is
split by job, each module importing only those listed before it:

- :mod:`~cbgen.server.schemas`, :mod:`~cbgen.server.metrics`: request models, Prometheus metrics;
- :mod:`~cbgen.server.errors`: OpenAI's error body and the app's exception handlers;
- :mod:`~cbgen.server.auth`: the API-key middleware;
- :mod:`~cbgen.server.state`: :class:`ServerLimits` and the per-app state (engine geometry, submission);
- :mod:`~cbgen.server.prompts`: prompt token ids, chat templating;
- :mod:`~cbgen.server.translate`: body reading, OpenAI fields → ``SamplingParams``, ``max_tokens``;
- :mod:`~cbgen.server.logprobs`: which logprob is reported and its two JSON shapes;
- :mod:`~cbgen.server.streaming`: stream merging, disconnect watching, the SSE response;
- :mod:`~cbgen.server.job`: one request's outputs rendered as SSE chunks or a final body;
- :mod:`~cbgen.server.routes`: :func:`build_app` and the route handlers;
- :mod:`~cbgen.server.cli`: ``cbgen serve``.
"""

from __future__ import annotations

from cbgen.server.cli import DEFAULT_SERVED_NAME, main
from cbgen.server.errors import APIError
from cbgen.server.logprobs import MISSING_LOGPROB
from cbgen.server.routes import build_app
from cbgen.server.state import ServerLimits

__all__ = ["DEFAULT_SERVED_NAME", "MISSING_LOGPROB", "APIError", "ServerLimits", "build_app", "main"]
