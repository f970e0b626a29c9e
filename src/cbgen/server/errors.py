"""OpenAI's error body, and how every failure inside the app is mapped onto it.

Errors always use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for any
invalid request (bad JSON or UTF-8, schema violations, limits), 401 for a missing or wrong API key,
404 for an unknown model or path, 408 for a body that does not arrive within ``--body-timeout``, 413
for a body over ``--max-body-bytes``, 429 when a bound on what is in flight (requests, token slots,
a client's share) is reached, 503 while shutting down.  Bad input never yields a 500.

Whatever a request holds (lone surrogates, NUL, bidi overrides, megabyte strings), an error body
encodes and stays small: user strings are quoted with :func:`quote` (escaped, cut short) and every
message and ``param`` is made printable and bounded when the error is made.  A client error logs
nothing of its own (uvicorn's access line is the one line it costs); an internal error logs one
bounded line (its whole traceback only at debug level), never the traceback uvicorn would print.
"""

from __future__ import annotations

import re
import reprlib
import traceback
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


# Bounds, in characters, on what an error body or log line repeats: a message, its ``param`` (a field
# path, which may hold the client's dict keys), and one quoted client string.
MESSAGE_CHARS = 1000
PARAM_CHARS = 200
QUOTE_CHARS = 64


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text`` safe to send and to log: every unprintable character but newline and tab (controls, NUL,
    lone surrogates, bidi overrides, zero-width marks) written as its escape, cut to about ``limit``
    characters."""
    cut = text[:limit]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() or c in "\n\t" else _escape(c) for c in cut)
    if len(cut) > limit or len(text) > limit:  # escapes lengthen it too
        return f"{cut[:limit]}... ({len(text):,} characters)"
    return cut


def _short_repr() -> reprlib.Repr:
    # reprlib abbreviates as it goes: a client's megabyte object or deep nesting costs little to quote.
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, QUOTE_CHARS, QUOTE_CHARS
    return r


_SHORT_REPR = _short_repr()


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A client's value for an error message or log line: the ``repr`` (quoted, unprintable characters
    escaped) of its first ``limit`` characters; a longer string ends in ``...`` and its length."""
    if isinstance(value, str):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text}... ({len(value):,} characters)"
    return printable(_SHORT_REPR.repr(value), limit)


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
        # Messages quote client input: made printable and bounded here, once, for every error path.
        message = printable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = None if param is None else printable(param, PARAM_CHARS)
        self.code = code

    def __reduce__(self) -> tuple:
        # Pickled (a child process's answer) as the fields already made safe, not escaped again.
        return (_restore_api_error, (self.status, self.message, self.type, self.param, self.code))

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status)


def _restore_api_error(
    status: int, message: str, type_: str, param: str | None, code: str | None
) -> APIError:
    err = APIError(status, "", type_, None, code)
    err.args, err.message, err.param = (message,), message, param
    return err


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
    # Drop union-member tags (e.g. "str", "list[int]") that pydantic adds to locations.  A location
    # may hold the client's dict keys: each part is cut short, so a long key leaves the message room.
    loc = [printable(str(p), QUOTE_CHARS) for p in first.get("loc", ()) if p not in ("body",)]
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


def log_internal_error(path: str, exc: BaseException) -> None:
    """One bounded line for an error the app did not expect: where, what, and its innermost frames (the
    whole traceback at debug level).  Its message may hold client input, so it is quoted."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    at = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    context = exc.__cause__ or exc.__context__  # e.g. an error handler that failed on its error
    during = f", while handling {type(context).__name__}" if context is not None else ""
    logger.error(
        "internal error on %s: %s: %s (at %s%s)",
        quote(path),
        type(exc).__name__,
        quote(str(exc), 200),
        at,
        during,
    )
    logger.debug("traceback of the internal error on %s", quote(path), exc_info=exc)


def _internal_error() -> JSONResponse:
    return APIError(500, "internal server error", "server_error").response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's last resort, which re-raises after answering: reached only by an error escaping
    # InternalErrorMiddleware, or in an app built without it.
    log_internal_error(request.url.path, exc)
    return _internal_error()


class InternalErrorMiddleware:
    """The outermost middleware of the app: an exception nothing else handled becomes a 500 with
    OpenAI's body and one bounded log line (:func:`log_internal_error`).

    Starlette answers such an exception itself but then re-raises it for the server to log, and
    uvicorn logs the whole traceback (kilobytes per request) and closes the connection.  Here it ends
    instead.  If the response had already started (a stream), the connection is left for uvicorn to
    close: its client sees a cut response rather than a complete-looking one.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as exc:
            log_internal_error(scope.get("path", ""), exc)
            if not started:
                await _internal_error()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error ``app`` can raise, including Starlette's and FastAPI's own, an OpenAI body.

    Add :class:`InternalErrorMiddleware` after every other middleware, so that it is the outermost."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected)
