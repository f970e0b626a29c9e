"""API-key check for the ``/v1`` routes."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from cbgen.server.errors import APIError


class APIKeyMiddleware:
    """Rejects ``/v1`` requests without the right bearer token (``/health`` and ``/metrics`` stay open).

    A plain ASGI middleware rather than a route dependency, so unknown ``/v1`` paths are covered too
    and nothing about the API (not even which routes exist) is visible without the key.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest even when the scheme is wrong, so timing says nothing about the key.
        ok = hmac.compare_digest(token.strip(), self._key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(
                401, "missing or invalid API key", "authentication_error", code="invalid_api_key"
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
