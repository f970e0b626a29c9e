"""End-to-end tests of ``cbgen serve``: real uvicorn processes serving SmolLM2-135M on 127.0.0.1.

Two server processes at most: a main one (OpenAI client, disconnects, load, bad input) and one with an
API key, which the last test also stops with SIGTERM in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time

import httpx
import openai
import pytest
from serverproc import HealthProbe, ServerProcess, metrics, wait_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "s3cret-key"
MAX_BODY = 64 * 1024
MAX_PROMPT = 256
MAX_LOGPROBS = 5
E2E_ARGS = [
    "--num-blocks", "512",
    "--max-prompt-tokens", str(MAX_PROMPT),
    "--max-tokens-limit", "512",
    "--max-n", "4",
    "--max-body-bytes", str(MAX_BODY),
    "--max-concurrent-requests", "200",
    "--max-logprobs", str(MAX_LOGPROBS),
    "--log-level", "warning",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(model_path, tmp_path_factory.mktemp("server"), "main", E2E_ARGS)
    proc.ensure_running()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def auth_server(model_path, tmp_path_factory):
    proc = ServerProcess(
        model_path, tmp_path_factory.mktemp("auth"), "auth", [*E2E_ARGS, "--api-key", API_KEY]
    )
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------------------------------------- (1) openai client
def test_models_and_health(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_with_openai_client(client):
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_with_openai_client(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_streaming_equals_non_streaming_with_seed(client, api):
    common = dict(model=MODEL, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    if api == "chat":
        kwargs = dict(common, messages=[{"role": "user", "content": "Tell me about the sea."}])
        full = client.chat.completions.create(**kwargs)
        stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        text, usage, reasons = "", None, []
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
                if ch.finish_reason:
                    reasons.append(ch.finish_reason)
        expected = full.choices[0].message.content
    else:
        kwargs = dict(common, prompt="Once upon a time")
        full = client.completions.create(**kwargs)
        stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        text, usage, reasons = "", None, []
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.text
                if ch.finish_reason:
                    reasons.append(ch.finish_reason)
        expected = full.choices[0].text
    assert text == expected
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n3_non_streaming_and_streaming(client):
    r = client.completions.create(
        model=MODEL, prompt="A list of fruits:", n=3, max_tokens=10, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 30
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], n=3, max_tokens=10,
        temperature=1.0, seed=5, stream=True,
    )  # fmt: skip
    texts, finished = {0: "", 1: "", 2: ""}, {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                assert ch.index not in finished, "a choice finished twice"
                finished[ch.index] = ch.finish_reason
    assert sorted(finished) == [0, 1, 2]
    assert all(texts.values())


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value < 0 or value == pytest.approx(0.0, abs=1e-6)  # the raw model logprob (greedy)
        assert 1 <= len(top) <= 3
        best = max(top, key=top.get)
        assert best == token and top[best] == pytest.approx(value, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0.7, seed=3,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) <= 2
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_stop_strings_and_vllm_extras(client):
    prompt = "Monday, Tuesday, Wednesday,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 3
    stop = words[2]  # a stop string the greedy continuation is known to produce
    cut = free[: free.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut
    assert r.choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True, "top_k": 5, "min_p": 0.05, "min_tokens": 1,
                    "skip_special_tokens": False, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut + stop


# ---------------------------------------------------------------------------------------------- (2) disconnects
def test_disconnect_mid_stream_aborts_request(server, client):
    tokens_before = wait_idle(server.url, 10)["cbgen_generation_tokens_total"]
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        # Keep the iterator referenced: dropping it would close the connection (httpx) right here.
        events = r.iter_lines()
        lines = [next(events) for _ in range(6)]
        assert any(line.startswith("data: {") for line in lines)
        assert metrics(server.url)["cbgen_num_requests_running"] == 1
    # The connection is closed now: the request must be aborted and its blocks freed.  What matters
    # is the ordering, not a time: idle before its 400 tokens ran out (the token counter says so).
    # 30 s only limits the wait; a steady run is idle in milliseconds (printed below).
    before = time.monotonic()
    idle = wait_idle(server.url, 30.0)
    assert idle["cbgen_generation_tokens_total"] < 400 + tokens_before, "the request ran to its end"
    print(f"\nstream disconnect -> idle in {time.monotonic() - before:.3f}s")
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_disconnect_while_waiting_for_non_streaming_response(server):
    tokens_before = wait_idle(server.url, 10)["cbgen_generation_tokens_total"]
    body = {"model": MODEL, "prompt": "Write a long essay:", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    # Aborted when the client left: idle before its 500 tokens ran out (an ordering, by the token
    # counter); 30 s only limits the wait.
    idle = wait_idle(server.url, 30.0)
    assert idle["cbgen_generation_tokens_total"] < 500 + tokens_before, "the request ran to its end"


# ---------------------------------------------------------------------------------------------- (3) load
def test_load_64_concurrent_streaming_clients(server):
    clients, per_client, max_tokens = 64, 2, 16
    before = metrics(server.url)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ttfts: list[float] = []
    results: list[tuple[str, int, int, str | None]] = []

    async def one(worker: int, k: int) -> None:
        start = time.perf_counter()
        first = None
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"Client {worker} request {k}: write a short poem about the number {worker * 7 + k}.",
            max_tokens=max_tokens, temperature=0.8, seed=worker * 100 + k, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        ids, usage, finishes, done_reason = set(), None, 0, None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if first is None:
                    first = time.perf_counter()
                if ch.finish_reason:
                    finishes += 1
                    done_reason = ch.finish_reason
        assert len(ids) == 1 and first is not None and usage is not None
        ttfts.append(first - start)
        results.append((ids.pop(), usage.completion_tokens, finishes, done_reason))

    async def worker(w: int) -> None:
        for k in range(per_client):
            await one(w, k)

    async def main() -> float:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(clients))), 240)
        finally:
            await aclient.close()
        return time.perf_counter() - start

    # The event loop must stay responsive while the engine thread steps: probe /health meanwhile.
    with HealthProbe(server.url, interval=0.1, keep_alive=True) as probe:
        wall = asyncio.run(main())
    assert not probe.failures, probe.failures[:3]
    probe_latencies = probe.latencies
    total = clients * per_client
    assert len(results) == total
    assert len({r[0] for r in results}) == total, "duplicated response ids"
    assert all(r[1] == max_tokens for r in results), "wrong token counts"
    assert all(r[2] == 1 and r[3] == "length" for r in results), "missing or repeated finish"
    ttfts.sort()
    p50 = statistics.median(ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    tokens = total * max_tokens
    print(
        f"\nload: {total} streamed requests x {max_tokens} tokens in {wall:.1f}s -> {tokens / wall:.0f} tok/s; "
        f"TTFT p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; /health during load: "
        f"max {max(probe_latencies) * 1000:.0f} ms over {len(probe_latencies)} probes"
    )
    # A blocked event loop answers no probe until the load ends (tens of seconds here); 10 s is a
    # margin a loaded 2-core machine keeps (a steady run's max is printed above).
    assert probe_latencies and max(probe_latencies) < 10.0
    after = wait_idle(server.url, 10)
    assert after["cbgen_generation_tokens_total"] - before["cbgen_generation_tokens_total"] == tokens
    assert (
        after["cbgen_request_success_total:length"] - before.get("cbgen_request_success_total:length", 0)
        == total
    )
    assert after["cbgen_time_to_first_token_seconds_count"] >= total
    assert httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------------------------- (4) bad input
def _post(server, path: str, body: bytes | dict, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30, **kwargs)


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_REQUESTS = [
    ("malformed_json", "/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": ', 400),
    ("not_an_object", "/v1/completions", b"[1, 2, 3]", 400),
    ("nan_literal", "/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "temperature": NaN}', 400),
    ("deep_nesting", "/v1/completions", b"[" * 20000, 400),
    ("missing_model", "/v1/completions", {"prompt": "Hello"}, 400),
    ("missing_prompt", "/v1/completions", {"model": MODEL}, 400),
    ("unknown_model", "/v1/completions", {**COMPLETION, "model": "gpt-17"}, 404),
    ("unknown_model_chat", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, 404),
    ("max_tokens_string", "/v1/completions", {**COMPLETION, "max_tokens": "16"}, 400),
    ("temperature_string", "/v1/completions", {**COMPLETION, "temperature": "hot"}, 400),
    ("prompt_number", "/v1/completions", {**COMPLETION, "prompt": 5}, 400),
    ("messages_string", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400),
    ("stream_not_bool", "/v1/completions", {**COMPLETION, "stream": "yes"}, 400),
    ("negative_max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": -5}, 400),
    ("zero_max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400),
    ("huge_max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": 10**12}, 400),
    ("n_zero", "/v1/completions", {**COMPLETION, "n": 0}, 400),
    ("n_over_limit", "/v1/completions", {**COMPLETION, "n": 100}, 400),
    ("negative_temperature", "/v1/completions", {**COMPLETION, "temperature": -1}, 400),
    ("top_p_zero", "/v1/completions", {**COMPLETION, "top_p": 0}, 400),
    ("prompt_over_limit", "/v1/completions", {**COMPLETION, "prompt": "hello " * 2000}, 400),
    ("empty_prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400),
    ("token_out_of_vocab", "/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**9]}, 400),
    ("unknown_role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("empty_messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400),
    ("image_part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("logprobs_over_max", "/v1/completions", {**COMPLETION, "logprobs": MAX_LOGPROBS + 1}, 400),
    ("top_logprobs_over_max", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400),
    ("min_tokens_over_max", "/v1/completions", {**COMPLETION, "min_tokens": 10}, 400),
    ("stream_options_without_stream", "/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400),
    ("bad_logit_bias_key", "/v1/completions", {**COMPLETION, "logit_bias": {"abc": 1}}, 400),
    ("too_many_stops", "/v1/completions", {**COMPLETION, "stop": [f"s{i}" for i in range(100)]}, 400),
    ("empty_stop", "/v1/completions", {**COMPLETION, "stop": [""]}, 400),
    ("invalid_utf8", "/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "\xff\xfe"}', 400),
    ("body_over_limit", "/v1/completions", {**COMPLETION, "prompt": "x" * (MAX_BODY + 10)}, 413),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "status"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_openai_error(server, case, path, body, status):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]


def test_chunked_body_over_limit_is_413(server):
    def chunks():
        yield b'{"model": "SmolLM2-135M-Instruct", "prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(server.url + "/v1/nothing-here", json={})
    assert r.status_code == 404 and "error" in r.json()


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_server_still_healthy_after_bad_input(server, client):
    r = client.completions.create(
        model=MODEL, prompt="Good input", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3
    wait_idle(server.url, 5)
    assert server.proc.poll() is None


# ---------------------------------------------------------------------------------------------- (5) API key
def test_api_key_required(auth_server):
    auth_server.ensure_running()
    url = auth_server.url
    assert httpx.get(url + "/health").status_code == 200  # health stays open
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"})
    assert r.status_code == 401
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL


# ---------------------------------------------------------------------------------------------- (6) SIGTERM
def test_sigterm_during_stream_ends_cleanly_and_exits_zero(auth_server):
    auth_server.ensure_running()
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    events: list[str] = []
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", auth_server.url + "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                auth_server.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 400  # aborted, not run to completion
    assert auth_server.proc.wait(30) == 0, auth_server.log_tail()


# ---------------------------------------------------------------------------------------------- in-process app
# Failure paths that a real process cannot be driven into on demand, checked on build_app() over a tiny
# random model (no tokenizer: token-id prompts, empty texts) through httpx's ASGI transport.
@pytest.fixture
def tiny_app():
    from cbgen import LLM
    from cbgen.async_engine import AsyncEngine
    from cbgen.server.app import ServerLimits, build_app
    from tiny_models import make_model

    llm = LLM(make_model("llama"), block_size=8, num_blocks=64)
    engine = AsyncEngine(llm, max_concurrent_requests=2)
    app = build_app(engine, None, "tiny", ServerLimits(max_logprobs=5), shutdown_engine_on_exit=False)
    yield engine, app
    engine.shutdown(timeout=30)


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny", timeout=60)


TINY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0}


def test_inprocess_step_failure_is_reported_not_hung(tiny_app):
    engine, app = tiny_app
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] in (2, 5):
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.engine.step = flaky_step

    async def main():
        async with _asgi_client(app) as http:
            r = await http.post("/v1/completions", json={**TINY, "stream": True})
            events = [line for line in r.text.splitlines() if line]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert "simulated kernel failure" in error["message"] and error["type"] == "server_error"
            calls["n"] = 3
            r = await http.post("/v1/completions", json=TINY)
            assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
            r = await http.post("/v1/completions", json=TINY)  # the loop survived
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6

    asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.stats().num_used_blocks == 0


def test_inprocess_queue_full_is_429_and_shutdown_is_503(tiny_app):
    engine, app = tiny_app

    async def main():
        async with _asgi_client(app) as http:
            with engine.pause():  # hold both admitted requests in flight
                first = [asyncio.ensure_future(http.post("/v1/completions", json=TINY)) for _ in range(2)]
                deadline = time.monotonic() + 10
                while engine.stats().in_flight < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                r = await http.post("/v1/completions", json=TINY)
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            for response in await asyncio.gather(*first):
                assert response.status_code == 200
            engine.start_shutdown()
            r = await http.post("/v1/completions", json=TINY)
            assert r.status_code == 503 and "error" in r.json()
            assert (await http.get("/health")).status_code == 503

    asyncio.run(asyncio.wait_for(main(), 60))


def test_inprocess_logprobs_without_tokenizer(tiny_app):
    _, app = tiny_app

    async def main():
        async with _asgi_client(app) as http:
            r = await http.post("/v1/completions", json={**TINY, "logprobs": 2})
            lp = r.json()["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == 6 and all(t.startswith("<") for t in lp["tokens"])
            r = await http.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
            )
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_inprocess_batched_prompts_with_n(tiny_app):
    _, app = tiny_app
    body = {**TINY, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "temperature": 1.0, "seed": 3}

    async def main():
        async with _asgi_client(app) as http:
            r = (await http.post("/v1/completions", json=body)).json()
            assert sorted(c["index"] for c in r["choices"]) == [0, 1, 2, 3]
            assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}
            sse = await http.post(
                "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            )
            chunks = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: {")]
            finishes = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
            assert sorted(finishes) == [0, 1, 2, 3]
            assert chunks[-1]["usage"]["completion_tokens"] == 24

    asyncio.run(asyncio.wait_for(main(), 60))
