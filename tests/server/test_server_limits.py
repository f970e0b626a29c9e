"""The server's limits on work, response size, slow bodies and slow readers, checked in-process on
``build_app()`` over a tiny random model (token-id prompts) through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cbgen.server.errors import APIError
from cbgen.server.streaming import SSEResponse, WriteTimeout, merge_streams
from cbgen.server.translate import parse_json

TINY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def tiny():
    from cbgen import LLM
    from cbgen.async_engine import AsyncEngine
    from cbgen.server.app import ServerLimits, build_app
    from tiny_models import make_model

    llm = LLM(make_model("llama"), block_size=8, num_blocks=64)
    engine = AsyncEngine(llm, max_concurrent_requests=8, max_inflight_work=200, client_share=0.5)
    limits = ServerLimits(max_request_work=150, max_response_bytes=20_000, body_timeout=0.5, max_n=8)
    app = build_app(engine, None, "tiny", limits, shutdown_engine_on_exit=False)
    yield engine, app
    engine.shutdown(timeout=30)


def _http(app, client: str = "10.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(client, 1234))
    return httpx.AsyncClient(transport=transport, base_url="http://tiny", timeout=60)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_request_work_over_the_limit_is_400_naming_both_numbers(tiny):
    _, app = tiny

    async def main():
        async with _http(app) as http:
            body = {**TINY, "prompt": [[5, 6, 7]] * 4, "n": 4, "max_tokens": 20}  # 16 x 23 = 368
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
            assert "368 token slots (16 sequences" in r.json()["error"]["message"] and "150" in r.text

    _run(main())


def test_non_streamed_response_too_large_is_refused_up_front_and_may_stream(tiny):
    engine, app = tiny

    async def main():
        async with _http(app) as http:
            body = {**TINY, "max_tokens": 40, "logprobs": 5, "n": 2}  # 2 x 40 x (16 + 6 x 64) = 32,000
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "response_too_large"
            assert r.json()["error"]["param"] == "stream"
            r = await http.post("/v1/completions", json={**body, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")

    _run(main())
    assert engine.stats().generated_tokens >= 80


def test_one_client_cannot_take_the_whole_budget(tiny):
    engine, app = tiny

    async def main():
        async with _http(app, "10.0.0.1") as a, _http(app, "10.0.0.2") as b:
            body = {**TINY, "max_tokens": 60}  # 63 token slots; a client's share is 100
            with engine.pause():
                first = asyncio.ensure_future(a.post("/v1/completions", json=body))
                while engine.stats().in_flight < 1:
                    await asyncio.sleep(0.01)
                second = await a.post("/v1/completions", json=body)
                assert (
                    second.status_code == 429 and "one client (10.0.0.1)" in second.json()["error"]["message"]
                )
                other = asyncio.ensure_future(b.post("/v1/completions", json=body))
                while engine.stats().in_flight < 2:
                    await asyncio.sleep(0.01)
            assert (await first).status_code == 200 and (await other).status_code == 200
            r = await a.post("/v1/completions", json={**TINY, "max_tokens": 120})  # 123 > a whole share
            assert r.status_code == 400 and "one client" in r.json()["error"]["message"]

    _run(main())
    assert engine.stats().inflight_work == 0


def test_a_body_that_does_not_arrive_in_time_is_408(tiny):
    _, app = tiny

    async def trickle():
        yield b'{"model": "tiny", '
        await asyncio.sleep(2)
        yield b'"prompt": [5], "max_tokens": 1}'

    async def main():
        async with _http(app) as http:
            r = await http.post("/v1/completions", content=trickle())
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"

    _run(main())


def test_lone_surrogates_are_refused_wherever_they_are():
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a pair is fine
    for body in (b'{"prompt": "a\\ud800b"}', b'{"stop": ["x", "\\uDFFF"]}', b'{"\\ud800": 1}'):
        with pytest.raises(APIError, match="lone UTF-16 surrogate") as info:
            parse_json(body)
        assert info.value.status == 400


class _Endless:
    """An endless stream of numbered items that counts how far it was read."""

    def __init__(self) -> None:
        self.read = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.read += 1
        await asyncio.sleep(0)
        return self.read

    def cancel(self) -> None:
        self.cancelled = True


def test_merged_streams_are_read_only_as_fast_as_the_merge_is_consumed():
    streams = [_Endless(), _Endless(), _Endless()]

    async def main():
        merged = merge_streams(streams)  # type: ignore[arg-type]
        got = []
        async for item in merged:
            got.append(item)
            if len(got) == 30:
                break
            await asyncio.sleep(0.001)  # a slow consumer
        await merged.aclose()
        return got

    got = _run(main())
    assert {i for i, _ in got} == {0, 1, 2}
    # One read ahead per stream at most: nothing piles up between the streams and the consumer.
    assert sum(s.read for s in streams) <= len(got) + len(streams)


def test_a_stream_write_that_waits_too_long_ends_the_response():
    stream = _Endless()

    async def body():
        while True:
            yield "data: {}\n\n"

    async def main():
        sent = []

        async def send(message):
            sent.append(message)
            if len(sent) > 3:
                await asyncio.Event().wait()  # the client stopped reading

        async def receive():
            await asyncio.Event().wait()

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "state": {}}
        with pytest.raises(WriteTimeout):
            await SSEResponse(body(), [stream], write_timeout=0.2)(scope, receive, send)  # type: ignore[list-item]
        return sent

    assert len(_run(main())) == 4
    assert stream.cancelled


def test_head_options_and_405(tiny):
    _, app = tiny

    async def main():
        async with _http(app) as http:
            assert (await http.head("/v1/models")).status_code == 200
            r = await http.options("/v1/completions")
            assert r.status_code == 204 and r.headers["allow"] == "POST, OPTIONS"
            assert (await http.options("/nowhere")).status_code == 404
            r = await http.delete("/health")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, OPTIONS"
            r = await http.post("/v1/completions/", json=TINY)
            assert r.status_code == 404 and "location" not in r.headers
            assert json.loads(r.text)["error"]["code"] == "not_found"

    _run(main())
