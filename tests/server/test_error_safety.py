"""Every error path answers safely whatever the input holds, and logs at most one short line.

The helpers that quote client strings (:func:`cbgen.server.errors.printable`, :func:`quote`), then
``build_app()`` over a tiny random model through httpx's ASGI transport: the issue's 103-byte body
(a lone surrogate as a ``logit_bias`` key, once a 500 with 11 KB of traceback), errors quoting
megabyte and unprintable strings, and internal errors (injected: a real server cannot be driven into
one on demand), before and after a response has started.  The ASGI transport raises whatever escapes
the app, which under uvicorn would be logged as a whole traceback.  The same claims against a real
``cbgen serve`` process, under random input: ``test_chat_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from starlette.responses import StreamingResponse

from cbgen.server.errors import MESSAGE_CHARS, APIError, printable, quote

UNSAFE = "\x00\u202e\ud800\udfff\x1b\u2066"  # NUL, bidi override, surrogates, escape, bidi isolate


def test_printable_escapes_what_a_terminal_or_encoder_would_trip_on():
    text = printable(f"a{UNSAFE}[31mb\n\tc é 😀")
    assert text == "a\\x00\\u202e\\ud800\\udfff\\x1b\\u2066[31mb\n\tc é 😀"
    text.encode("utf-8")  # no surrogate left
    long = printable("\x00" * 100_000)
    assert len(long) < MESSAGE_CHARS + 40 and long.endswith("(100,000 characters)")


def test_quote_is_a_bounded_escaped_repr():
    assert quote("a\u202eb") == "'a\\u202eb'"
    assert quote("x" * 10_000) == f"'{'x' * 64}'... (10,000 characters)"
    assert len(quote({"k": ["\ud800" * 1000]})) < 200 and "\ud800" not in quote({"k": "\ud800"})
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert quote(nested) == "[[[[...]]]]"  # abbreviated, not repr's RecursionError


def test_api_error_bodies_always_encode_and_stay_bounded():
    error = APIError(400, "bad " + UNSAFE * 50_000, param="logit_bias." + UNSAFE * 1000)
    body = json.loads(error.response().body)["error"]
    assert len(body["message"]) < MESSAGE_CHARS + 40 and len(body["param"]) < 250
    assert not any(c in body["message"] + body["param"] for c in UNSAFE)


# ---------------------------------------------------------------------------------------------- in-process app
@pytest.fixture(scope="module")
def tiny():
    from cbgen import LLM
    from cbgen.async_engine import AsyncEngine
    from cbgen.server.app import ServerLimits, build_app
    from tiny_models import make_model

    llm = LLM(make_model("llama"), block_size=8, num_blocks=64)
    engine = AsyncEngine(llm, max_concurrent_requests=4)
    app = build_app(engine, None, "tiny", ServerLimits(), shutdown_engine_on_exit=False)
    yield app
    engine.shutdown(timeout=30)


def _post(app, path: str, raw: bytes) -> httpx.Response:
    async def main() -> httpx.Response:
        # raise_app_exceptions (the default): anything escaping the app fails the test.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny", timeout=60) as http:
            return await http.post(path, content=raw, headers={"content-type": "application/json"})

    return asyncio.run(asyncio.wait_for(main(), 60))


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = json.loads(r.content.decode("utf-8"))  # strict UTF-8: a surrogate would not decode
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_the_issues_surrogate_key_is_a_400_with_no_log(tiny, caplog):
    raw = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"logit_bias":{"\\ud800":1}}'
    with caplog.at_level(logging.DEBUG, logger="cbgen"):
        error = _error(_post(tiny, "/v1/chat/completions", raw), 400)
    assert error["param"] == "logit_bias" and "lone UTF-16 surrogate" in error["message"]
    assert "'\\ud800'" in error["message"]  # the key, quoted escaped
    assert not caplog.records


@pytest.mark.parametrize("key", ["\u0661\u0662", "\uff11\uff12", "\u0967"])
def test_logit_bias_keys_are_ascii_token_ids(tiny, key):
    """Arabic-Indic, fullwidth and Devanagari digits are digits to str.isdecimal and int(), not ids."""
    raw = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1, "logit_bias": {key: 1}}).encode()
    error = _error(_post(tiny, "/v1/completions", raw), 400)
    assert error["param"] == "logit_bias"


@pytest.mark.parametrize(
    ("case", "body", "status", "param"),
    [
        # A long unprintable model name is quoted cut short, with its length.
        ("model", {"model": "\u202e" * 100_000, "prompt": [1]}, 404, "model"),
        (
            "logit_bias_key",
            {"model": "tiny", "prompt": [1], "logit_bias": {"\x00" * 50_000: 1}},
            400,
            "logit_bias",
        ),
        # A schema violation under a client's key: the location's parts are cut short.
        (
            "validation_key",
            {"model": "tiny", "prompt": [1], "logit_bias": {"\u2066" * 50_000: "x"}},
            400,
            None,
        ),
        (
            "surrogate_deep",
            {"model": "tiny", "prompt": [1], "x": [{"\x00" * 9_000: {"\u202e": "\ud800"}}]},
            400,
            None,
        ),
    ],
)
def test_errors_quoting_hostile_strings_are_short_and_printable(tiny, caplog, case, body, status, param):
    with caplog.at_level(logging.DEBUG, logger="cbgen"):
        error = _error(_post(tiny, "/v1/completions", json.dumps(body).encode()), status)
    assert len(error["message"]) <= MESSAGE_CHARS + 40, len(error["message"])
    assert not any(c in error["message"] + (error["param"] or "") for c in UNSAFE)
    assert param is None or error["param"] == param
    assert len(error["param"] or "") <= 250
    assert not caplog.records


def _raise_internal(*args, **kwargs):
    raise RuntimeError("internal \ud800\u202e" + "x" * 100_000)


def test_an_internal_error_is_a_500_and_one_short_log_line(tiny, caplog, monkeypatch):
    monkeypatch.setattr("cbgen.server.routes.run_plan", _raise_internal)
    raw = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1}).encode()
    with caplog.at_level(logging.INFO, logger="cbgen"):
        error = _error(_post(tiny, "/v1/completions", raw), 500)
    assert error == {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    (record,) = caplog.records
    line = record.getMessage()
    assert record.levelno == logging.ERROR and record.exc_info is None
    assert "RuntimeError" in line and "/v1/completions" in line and "\n" not in line
    assert len(line) < 800 and not any(c in line for c in UNSAFE)


def test_an_internal_error_keeps_its_traceback_for_debug_logging(tiny, caplog, monkeypatch):
    monkeypatch.setattr("cbgen.server.routes.run_plan", _raise_internal)
    raw = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1}).encode()
    with caplog.at_level(logging.DEBUG, logger="cbgen"):
        _error(_post(tiny, "/v1/completions", raw), 500)
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.DEBUG]
    assert caplog.records[1].exc_info is not None


def test_an_internal_error_after_the_response_started_ends_it_quietly(tiny, caplog, monkeypatch):
    async def broken_stream(*args, **kwargs):
        async def chunks():
            yield "data: {}\n\n"
            _raise_internal()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    monkeypatch.setattr("cbgen.server.routes.run_plan", broken_stream)
    raw = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
        "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("tiny", 80), "state": {},
    }  # fmt: skip
    sent: list[dict] = []

    bodies = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO, logger="cbgen"):
        # httpx's ASGI transport cannot stand for uvicorn here (it requires a completed response), so
        # the app is called as uvicorn calls it: nothing may escape it.
        asyncio.run(asyncio.wait_for(tiny(scope, receive, send), 60))
    # The status went out before the failure; the body is left unfinished (no [DONE], no final
    # empty message), for uvicorn to close the connection: the client sees a cut stream.
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert all(m.get("more_body") for m in sent[1:])
    assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and len(record.getMessage()) < 800
