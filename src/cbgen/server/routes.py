"""The FastAPI app: its routes, each parsing a request, planning it and handing it to a job."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cbgen.async_engine import AsyncEngine
from cbgen.server.auth import APIKeyMiddleware
from cbgen.server.errors import ALLOWED_METHODS, InternalErrorMiddleware, install_error_handlers
from cbgen.server.generation import run_plan
from cbgen.server.metrics import CONTENT_TYPE
from cbgen.server.state import LARGE_BYTES, OFFLOAD_BYTES, ServerLimits, ServerState
from cbgen.server.structured import prepare_structured_output
from cbgen.server.translate import GenerationPlan, plan_request, read_body

# Handlers are module-level and find their app's state on the request, so one router serves any app.
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.cbgen


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    """200 while the engine runs, 503 once it has stopped or is shutting down."""
    if _state(request).engine.is_running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request) -> Response:
    """Prometheus metrics."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(request: Request) -> JSONResponse:
    """The one model this server serves."""
    state = _state(request)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "cbgen",
        "max_model_len": state.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def _options(request: Request) -> Response:
    """The methods a path allows (no CORS: browsers' cross-origin requests are not served)."""
    return Response(status_code=204, headers={"Allow": ALLOWED_METHODS[request.url.path]})


for _path in ALLOWED_METHODS:
    router.add_api_route(_path, _options, methods=["OPTIONS"], include_in_schema=False)


async def _plan(request: Request, state: ServerState, chat: bool) -> GenerationPlan:
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.body_timeout)
    if len(raw) >= OFFLOAD_BYTES:
        return await state.off_loop(lambda: plan_request(state, chat, raw), large=len(raw) >= LARGE_BYTES)
    return plan_request(state, chat, raw)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI text completions, streamed with SSE or answered whole."""
    arrival = time.monotonic()
    state = _state(request)
    return await run_plan(state, await _plan(request, state, chat=False), request, arrival)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streamed with SSE or answered whole."""
    arrival = time.monotonic()
    state = _state(request)
    return await run_plan(state, await _plan(request, state, chat=True), request, arrival)


def build_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    served_model_name: str,
    limits: ServerLimits | None = None,
    shutdown_engine_on_exit: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``async_engine`` as ``served_model_name``.

    With ``shutdown_engine_on_exit`` the app's lifespan shutdown aborts in-flight requests and stops
    the engine thread.
    """
    limits = limits or ServerLimits()

    state = ServerState(async_engine, tokenizer, served_model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The grammar library's tokenizer takes ~1.6 s to build for SmolLM2: at start, off the event
        # loop, rather than in the first constrained request.
        await prepare_structured_output(state)
        yield
        state.close()
        if shutdown_engine_on_exit:
            await asyncio.to_thread(async_engine.shutdown, True, 30.0)

    # No trailing-slash redirects: they answer with an absolute URL built from the Host header.
    app = FastAPI(
        title="cbgen",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.state.cbgen = state
    install_error_handlers(app)
    app.include_router(router)
    if limits.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=limits.api_key)
    # Last added, so outermost: nothing raised inside reaches uvicorn, which would log a traceback.
    app.add_middleware(InternalErrorMiddleware)
    return app
