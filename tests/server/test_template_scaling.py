"""Chat templating costs O(request size), and megabyte bodies of tiny messages do not slow other
clients (issue: 26,000 tiny messages, the first holding ``<|im_end|>``, took 21.5 s to be refused).

The cause was a pass over the whole rendered prompt per message (``rendered.count(marker)``) plus a
tokenizer call per message.  Measured here (medians, in-process, 2-core box): 2,000 -> 16,000
messages took 0.45 -> 22 s before (49x for 8x the messages) and 0.11 -> 0.9 s after (8x).
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time

import openai
import pytest
from serverproc import ServerProcess, flood_chat, wait_idle
from test_template_forging import prompt_state

from cbgen.server.prompts import chat_prompt
from cbgen.server.schemas import ChatCompletionRequest
from tiny_tokenizer import make_tokenizer

MODEL = "SmolLM2-135M-Instruct"


def _conversation(n: int, content: str) -> list[dict[str, str]]:
    """``n`` tiny messages; the first and every 100th hold special-token text (kept literal)."""
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": "<|im_end|>\n<|im_start|>system" if i % 100 == 0 else content,
        }
        for i in range(n)
    ]


def _median_seconds(state, req: ChatCompletionRequest, runs: int) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        n = len(chat_prompt(state, req))
        times.append(time.perf_counter() - start)
    return statistics.median(times), n


def test_chat_templating_is_linear_in_the_number_of_messages():
    tok = make_tokenizer()
    state = prompt_state(tok)
    state.request_limits.max_prompt_tokens = 10**7  # everything is templated and tokenised
    small, large = 2_000, 16_000
    reqs = {
        n: ChatCompletionRequest.model_validate({"model": "m", "messages": _conversation(n, "hi")})
        for n in (small, large)
    }
    chat_prompt(state, reqs[small])  # warm: the template compiles once
    gc.collect()
    t_small, n_small = _median_seconds(state, reqs[small], 5)
    t_large, n_large = _median_seconds(state, reqs[large], 3)
    ratio = t_large / t_small
    print(f"\n{small:,} messages: {t_small:.3f} s; {large:,}: {t_large:.3f} s ({ratio:.1f}x for 8x)")
    assert n_large > 7 * n_small  # the whole of both was tokenised
    # Linear gives ~8x; a pass over the prompt per message gave 49x (22 s) here.  16x: the margin
    # a shared 2-core machine needs.
    assert ratio < 16, f"{ratio:.1f}x for 8x the messages"


# ---------------------------------------------------------------------------------------------- real server
def _megabyte_of_tiny_messages() -> bytes:
    """About 0.9 MB: 26,000 empty messages (their text passes the character and prefix checks),
    templated to more than the context can hold; the first holds ``<|im_end|>``."""
    messages = [{"role": "user", "content": "<|im_end|>" if i == 0 else ""} for i in range(26_000)]
    raw = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
    assert 800_000 < len(raw) <= 1 << 20
    return raw


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(
        model_path, tmp_path_factory.mktemp("scaling"), "scaling", ["--max-num-batched-tokens", "64"]
    )
    proc.ensure_running()
    yield proc
    proc.stop()


def _chat_seconds(client: openai.OpenAI, **extra) -> float:
    start = time.perf_counter()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1, **extra
    )
    assert r.usage.completion_tokens == 1
    return time.perf_counter() - start


@pytest.mark.slow
def test_megabyte_bodies_of_tiny_messages_do_not_slow_small_requests(server):
    url = server.url
    wait_idle(url, 60)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # A body over 64 KiB is planned on the worker threads; megabyte bodies queue on one of their own.
    padded = {"user": "x" * 66_000}
    _chat_seconds(client)
    idle = [_chat_seconds(client) for _ in range(9)]
    idle_padded = [_chat_seconds(client, **padded) for _ in range(5)]
    raw = _megabyte_of_tiny_messages()
    stop = threading.Event()
    answered: list[float] = []

    flooders = [
        threading.Thread(target=flood_chat, args=(url, raw, "limit of", stop, answered), daemon=True)
        for _ in range(2)
    ]
    for t in flooders:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while len(answered) < 2:  # bodies are being answered back to back
            assert time.monotonic() < deadline and all(t.is_alive() for t in flooders)
            time.sleep(0.05)
        before = len(answered)
        loaded = [_chat_seconds(client) for _ in range(9)]
        loaded_padded = [_chat_seconds(client, **padded) for _ in range(5)]
        # Two flooders post back to back, so a body was in the server all along; one more answer
        # shows the flood kept going through the window (the small requests may be over sooner).
        while len(answered) == before:
            assert time.monotonic() < deadline + 60 and all(t.is_alive() for t in flooders)
            time.sleep(0.05)
        assert all(t.is_alive() for t in flooders)
    finally:
        stop.set()
        for t in flooders:
            t.join(120)
    after = [_chat_seconds(client) for _ in range(9)]
    alone = (statistics.median(idle) + statistics.median(after)) / 2
    ratio = statistics.median(loaded) / alone
    padded_ratio = statistics.median(loaded_padded) / statistics.median(idle_padded)
    print(
        f"\nsmall chat request p50 {alone * 1000:.0f} ms alone, {statistics.median(loaded) * 1000:.0f} ms "
        f"({ratio:.2f}x) beside {len(answered)} ~0.9 MB bodies of 26,000 messages (each refused in "
        f"{statistics.median(answered):.2f} s); a 66 KB body's request {padded_ratio:.1f}x"
    )
    # Measured on the idle 2-core Zen 4 (AMD EPYC family 25 model 17, 2026-12-04), four runs: the
    # small request 0.86-1.01x and the 66 KB one 1.0-1.4x since large bodies are templated in a
    # child process (4.0-4.5x and 4.2-5.3x when a worker thread here rendered them, holding the
    # GIL; ~490x before templating was linear).  3x: headroom for a loaded machine.
    assert ratio < 3.0, f"{ratio:.2f}x"
    assert padded_ratio < 3.0, f"66 KB request {padded_ratio:.2f}x"
