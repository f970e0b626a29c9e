"""vLLM's stop semantics through ``cbgen serve`` and the official ``openai`` client.

A stop token's text is left out of the choice's text unless ``include_stop_str_in_output``, in the
stream as in the whole response; ``min_tokens`` holds back stop strings as it holds back stop tokens.
"""

from __future__ import annotations

import openai
import pytest
from serverproc import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "Count from one to fifty, separated by commas: one, two, three,"
PERIOD = 30  # SmolLM2's "." token
ARGS = ["--num-blocks", "256", "--max-tokens-limit", "256", "--log-level", "warning"]


@pytest.fixture(scope="module")
def client(model_path, tmp_path_factory):
    proc = ServerProcess(model_path, tmp_path_factory.mktemp("stop"), "stop", ARGS)
    proc.ensure_running()
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    proc.stop()


def _chat(client: openai.OpenAI, stream: bool, **extra) -> tuple[str, str | None, object]:
    """(text, finish_reason, stop_reason) of one greedy chat completion, streamed or not."""
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=64, temperature=0, extra_body=extra)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]
    text, finish, stop_reason = "", None, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish, stop_reason = choice.finish_reason, choice.model_extra.get("stop_reason")
    return text, finish, stop_reason


def _complete(client: openai.OpenAI, stream: bool, **extra) -> tuple[str, str | None]:
    kwargs = dict(model=MODEL, prompt=COUNT, max_tokens=20, temperature=0, extra_body=extra)
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_text_is_left_out(client, stream):
    free, finish, _ = _chat(client, stream)
    assert free.endswith("Paris.") and finish == "stop"
    assert _chat(client, stream, stop_token_ids=[PERIOD]) == (free[:-1], "stop", PERIOD)
    kept = _chat(client, stream, stop_token_ids=[PERIOD], include_stop_str_in_output=True)
    assert kept == (free, "stop", PERIOD)
    # EOS with special tokens kept: its text is not in the output unless asked for.
    assert _chat(client, stream, skip_special_tokens=False) == (free, "stop", None)
    raw = _chat(client, stream, skip_special_tokens=False, include_stop_str_in_output=True)
    assert raw == (free + "<|im_end|>", "stop", None)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings(client, stream):
    assert _complete(client, stream, stop=[", "]) == (" four", "stop")
    # No stop string completes inside the first 8 tokens (" four, five, six, seven,"); the 9th
    # completes the ", " begun by the 8th.
    assert _complete(client, stream, stop=[", "], min_tokens=8) == (" four, five, six, seven", "stop")
    assert _complete(client, stream, stop=[", "], min_tokens=8, include_stop_str_in_output=True) == (
        " four, five, six, seven, ",
        "stop",
    )
