"""Structured output and tool calls through the OpenAI-compatible server, with the ``openai`` client.

The servers run in this process (uvicorn on a thread, 127.0.0.1): a tiny Llama with the tiny
tokenizer and a Hermes-style chat template built here, and (slow) SmolLM2 for the 64-of-64 schema
check.  For ``tool_choice="auto"`` the tiny model is first taught, by a few hundred optimizer steps
on one conversation, to answer it with text and a ``<tool_call>`` block, so the parsing path sees a
real model output; ``"required"`` and named functions are checked on an untrained model, where only
the grammar can make the output a valid call.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest
import torch

from extras import require_extra

require_extra("llguidance")
openai = require_extra("openai")
uvicorn = require_extra("uvicorn")

from cbgen import LLM  # noqa: E402
from cbgen.async_engine import AsyncEngine  # noqa: E402
from cbgen.server.routes import build_app  # noqa: E402
from cbgen.server.tools import ToolCallStream, parse_tool_calls  # noqa: E402
from structured_helpers import PERSON_SCHEMA, schema_errors  # noqa: E402
from tiny_models import make_model  # noqa: E402
from tiny_tokenizer import PLAIN_CHAT_TEMPLATE, make_tokenizer  # noqa: E402

EOS = 2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "hours24": {"type": "boolean"}},
            "required": ["zone", "hours24"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TAUGHT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}


class _Server:
    """A cbgen server for ``llm`` on a free 127.0.0.1 port, in a thread of this process."""

    def __init__(self, llm: LLM, name: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = build_app(AsyncEngine.from_llm(llm), llm.tokenizer, name)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=600)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _teach(model, tok, messages, tools, answer: str, steps: int = 300) -> None:
    """Trains ``model`` until greedy decoding answers the rendered conversation with ``answer`` + EOS."""
    prompt = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    target = [*tok.encode(answer), EOS]
    ids = torch.tensor([list(prompt) + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        out = model(input_ids=ids, labels=labels)
        # Teacher-forced argmax right at every answer position: greedy decoding reproduces it.
        learned = out.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist() == target
        if learned and out.loss.item() < 0.05:
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=len(target) + 2, do_sample=False)
    assert out[0, len(prompt) :].tolist()[: len(target)] == target, (
        "setup: the model did not learn the answer"
    )


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    model = make_model("llama", max_position_embeddings=1024)
    _teach(model, tok, ASK, TOOLS, TAUGHT)
    server = _Server(LLM(model, tok, num_blocks=512), "tiny")
    yield server
    server.close()


def _stream_chat(client, **kwargs):
    """Content, tool calls (accumulated as the openai client's users do) and finish reasons."""
    content, calls, finish = "", {}, []
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finish


def _check_call(name: str, arguments: str) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[name]
    assert not schema_errors(json.loads(arguments), tool["function"]["parameters"]), arguments


# ---------------------------------------------------------------------------------------- tools
def test_auto_parses_the_models_tool_call(tiny):
    r = tiny.client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_streamed(tiny):
    content, calls, finish = _stream_chat(
        tiny.client, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60
    )
    assert content == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather"] and json.loads(calls[0]["arguments"]) == {
        "city": "Paris"
    }
    assert calls[0]["id"].startswith("call_") and finish == ["tool_calls"]


def test_none_returns_text(tiny):
    r = tiny.client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == TAUGHT


@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel"])
@pytest.mark.parametrize("stream", [False, True])
def test_required_forces_valid_calls(tiny, stream, parallel):
    """An unrelated question: without the grammar the model would not call anything.  With one call
    the grammar ends the answer after it; with parallel calls (the default) it allows any number, so
    whether a sample stops within ``max_tokens`` is the model's draw, not the grammar's: an answer
    cut at the limit holds only complete valid calls and the start of another."""
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    if stream:
        content, calls, finish = _stream_chat(tiny.client, **kw)
    else:
        choice = tiny.client.chat.completions.create(model="tiny", **kw).choices[0]
        content, finish = choice.message.content, [choice.finish_reason]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ]
    if finish == ["length"] and parallel:
        assert content.startswith("<tool_call>"), content
    else:
        assert finish == ["tool_calls"] and not content
    assert calls if parallel else len(calls) == 1
    for call in calls:
        _check_call(call["name"], call["arguments"])


def test_named_function_once(tiny):
    r = tiny.client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=1,
        n=3,
        max_tokens=200,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        _check_call("get_time", call.function.arguments)


def test_tool_results_in_the_conversation(tiny):
    """An assistant turn with tool_calls and the tool's answer render through the template."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = tiny.client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_requests_are_400(tiny):
    bad = [
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            tiny.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **kwargs)
        assert err.value.body["param"].startswith(param), err.value.body


def test_template_without_tools_is_400():
    tok = make_tokenizer(chat_template=PLAIN_CHAT_TEMPLATE)
    server = _Server(LLM(make_model("llama"), tok, num_blocks=64), "plain")
    try:
        with pytest.raises(openai.BadRequestError, match="does not support tools"):
            server.client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=5)
        r = server.client.chat.completions.create(model="plain", messages=ASK, max_tokens=3)
        assert r.choices[0].message.content is not None
    finally:
        server.close()


# ---------------------------------------------------------------------------------------- structured
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(tiny, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SMALL_SCHEMA, "strict": True}}
    kw = dict(messages=ASK, response_format=fmt, temperature=1.0, seed=5, n=2, max_tokens=120)
    if stream:
        texts: dict[int, str] = {}
        for chunk in tiny.client.chat.completions.create(model="tiny", stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        outputs = [texts[i] for i in sorted(texts)]
    else:
        outputs = [c.message.content for c in tiny.client.chat.completions.create(model="tiny", **kw).choices]
    assert len(outputs) == 2
    for text in outputs:
        assert not schema_errors(json.loads(text), SMALL_SCHEMA), text


def test_json_object_and_guided_fields(tiny):
    r = tiny.client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, max_tokens=200, seed=0
    )
    if r.choices[0].finish_reason == "stop":  # any object: a random model may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    comp = tiny.client.completions
    out = comp.create(
        model="tiny", prompt="pick:", max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].text in ("yes", "no")
    out = comp.create(
        model="tiny", prompt="code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"}
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", out.choices[0].text)
    out = comp.create(model="tiny", prompt="{", max_tokens=120, extra_body={"guided_json": SMALL_SCHEMA})
    assert not schema_errors(json.loads(out.choices[0].text), SMALL_SCHEMA)
    out = comp.create(
        model="tiny", prompt="x", max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert re.fullmatch("[0-9]{4}", out.choices[0].text)


def test_bad_constraints_are_400_before_queueing(tiny):
    cases = [
        (
            dict(extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}),
            "guided_json",
        ),
        (dict(extra_body={"guided_regex": "a(b"}), "guided_regex"),
        (dict(extra_body={"guided_choice": []}), "guided_choice"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
            "response_format",
        ),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            tiny.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **kwargs)
        assert err.value.body["param"].startswith(param), err.value.body


# ---------------------------------------------------------------------------------------- parsing
def test_stream_parser_holds_back_only_what_could_be_a_marker():
    text = 'Sure <b>x</b>.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g"}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        parser, content, calls = ToolCallStream(), "", []
        for i in range(0, len(text), size):
            got, new = parser.feed(text[i : i + size])
            content += got
            calls += new
        content += parser.finish()
        assert content == "Sure <b>x</b>."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("f", {"a": 1}),
            ("g", {}),
        ]
    assert parse_tool_calls("no calls <tool_call>oops</tool_call>") == (
        "no calls <tool_call>oops</tool_call>",
        [],
    )
    content, calls = parse_tool_calls(text)
    assert content == "Sure <b>x</b>." and len(calls) == 2
    parser = ToolCallStream()
    assert parser.feed("<tool_call>\n{unfinished") == ("", [])
    assert parser.finish() == "<tool_call>\n{unfinished"
    parser = ToolCallStream()  # no call at all: every character comes out, trailing spaces too
    assert parser.feed("a <tool") == ("a", []) and parser.feed("s> \n") == (" <tools>", [])
    assert parser.finish() == " \n"


# ---------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_64_of_64_through_the_server(smollm2_path):
    """64 concurrent chat requests with a strict json_schema response format, half of them streamed."""
    server = _Server(LLM(str(smollm2_path)), "smollm2")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}

    async def one(client, i: int) -> str:
        kw = dict(
            model="smollm2",
            messages=[{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}],
            response_format=fmt,
            temperature=0.7,
            seed=i,
            max_tokens=160,
        )
        if i % 2:
            return (await client.chat.completions.create(**kw)).choices[0].message.content
        text = ""
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.url, api_key="unused", max_retries=0, timeout=1200
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    try:
        texts = asyncio.run(run())
    finally:
        server.close()
    invalid = []
    for text in texts:
        try:
            errors = schema_errors(json.loads(text), PERSON_SCHEMA)
        except ValueError as exc:
            errors = [str(exc)]
        if errors:
            invalid.append((text, errors))
    assert not invalid, invalid
