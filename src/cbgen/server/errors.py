"""OpenAI's error body, and how every failure inside the app is mapped onto it.

Errors always use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for any
invalid request (bad JSON or UTF-8, schema violations, limits), 401 for a missing or wrong API key,
404 for an unknown model or path, 408 for a body that does not arrive within ``--body-timeout``, 413
for a body over ``--max-body-bytes``, 429 when a bound on what is in flight (requests, token slots,
a client's share) is reached, 503 while shutting down.  Bad input never yields a 500.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from cbgen.utils import get_logger

logger = get_logger("cbgen.server")

# The methods of each path (OPTIONS answers, and the Allow header of a 405).
ALLOWED_METHODS = {
    "/health": "GET, HEAD, OPTIONS",
    "/metrics": "GET, HEAD, OPTIONS",
    "/v1/models": "GET, HEAD, OPTIONS",
    "/v1/completions": "POST, OPTIONS",
    "/v1/chat/completions": "POST, OPTIONS",
}


class APIError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``, blaming ``param`` when one field is at fault."""
    return APIError(400, message, param=param)


def sampling_param_of(message: str) -> str | None:
    """The request field a ``SamplingParams`` error message names, if it names one."""
    m = re.search(r"SamplingParams\.(\w+)", message)
    return m.group(1) if m else None


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 describing the first schema violation, with its location as ``param``."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    # Drop union-member tags (e.g. "str", "list[int]") that pydantic adds to locations.
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = (
        ".".join(p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|function-.*", p))
        or None
    )
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}{more}", param=param)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    response = APIError(exc.status_code, str(exc.detail), param=None, code=code).response()
    response.headers.update(exc.headers or {})
    if exc.status_code == 405 and request.url.path in ALLOWED_METHODS:
        # Starlette names the methods of the one route it matched; a path here has two.
        response.headers["Allow"] = ALLOWED_METHODS[request.url.path]
    return response


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal server error", "server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error ``app`` can raise, including Starlette's and FastAPI's own, an OpenAI body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected)
