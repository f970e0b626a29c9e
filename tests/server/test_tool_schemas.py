"""Tool schemas, grammar-library limits and the grammar backend's start, through the server.

The servers run in this process (uvicorn on a thread, see ``test_structured_tools``) with the tiny
Llama, the tiny tokenizer and its Hermes chat template, and are asked with the ``openai`` client.
The model is untrained: only the grammar makes its output a valid call, so a forced call that
validates shows the grammar the tool's schema compiled to.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from extras import require_extra

require_extra("llguidance")
openai = require_extra("openai")
require_extra("uvicorn")

from test_structured_tools import ASK, TOOLS, _Server  # noqa: E402

from cbgen import LLM  # noqa: E402
from structured_helpers import schema_errors  # noqa: E402
from tiny_models import make_model  # noqa: E402
from tiny_tokenizer import make_tokenizer  # noqa: E402


def _pydantic_style(title: str, address: dict[str, Any], field: str) -> dict[str, Any]:
    """A schema as pydantic writes a model with a nested one: the nested model under ``$defs``."""
    return {
        "$defs": {
            "Address": {
                "title": "Address",
                "type": "object",
                "properties": address,
                "required": sorted(address),
                "additionalProperties": False,
            }
        },
        "title": title,
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, field: {"$ref": "#/$defs/Address"}},
        "required": ["name", field],
        "additionalProperties": False,
    }


# Two tools whose schemas both define "Address", differently: each "$ref" must resolve from the root
# of its own tool's schema.
REGISTER = {
    "type": "function",
    "function": {
        "name": "register",
        "parameters": _pydantic_style(
            "Person",
            {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "home",
        ),
    },
}
SHIP = {
    "type": "function",
    "function": {
        "name": "ship",
        "parameters": _pydantic_style("Parcel", {"port": {"enum": ["north", "south"]}}, "to"),
    },
}
REF_TOOLS = [REGISTER, SHIP]
WEATHER_TOOL = TOOLS[0]


def _inlined(schema: Any, root: dict[str, Any]) -> Any:
    """``schema`` with every ``#/...`` pointer replaced by what it names in ``root`` (no cycles)."""
    if isinstance(schema, list):
        return [_inlined(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return _inlined(target, root)
    return {k: _inlined(v, root) for k, v in schema.items() if k != "$defs"}


def _check(call: Any, tools: list[dict[str, Any]]) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict), call.function.arguments
    assert not schema_errors(args, _inlined(params, params)), call.function.arguments


@pytest.fixture(scope="module")
def server():
    llm = LLM(make_model("llama", max_position_embeddings=2048), make_tokenizer(), num_blocks=512)
    server = _Server(llm, "tiny")
    yield server
    server.close()


# ---------------------------------------------------------------------------------------- item: $ref
@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "function": {"name": "register"}},
        {"type": "function", "function": {"name": "ship"}},
    ],
    ids=["required", "named-register", "named-ship"],
)
def test_defs_and_refs_resolve_from_each_tools_root(server, choice):
    """Was a 400 ``Pointer '/$defs/Address' does not exist``: the schemas sat under ``anyOf`` then."""
    r = server.client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=REF_TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=300,
    )
    names = set()
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        _check(call, REF_TOOLS)
        names.add(call.function.name)
    if isinstance(choice, dict):
        assert names == {choice["function"]["name"]}


def test_recursive_ref_to_the_tools_root_is_accepted(server):
    """``"$ref": "#"`` names the tool's own schema (a linked list here), not the whole grammar (in the
    old combined schema it named the ``anyOf`` of calls, so a nested node came out as a call)."""
    node = {
        "type": "object",
        "properties": {"v": {"enum": [1, 2]}, "next": {"$ref": "#"}},
        "required": ["v"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "chain", "parameters": node}}
    r = server.client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=11,
        n=6,
        max_tokens=250,
    )
    depths = []
    for c in r.choices:
        if c.finish_reason == "length":  # an untrained model may nest past max_tokens
            continue
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        args, depth = json.loads(call.function.arguments), 0
        while args is not None:
            assert set(args) <= {"v", "next"} and args["v"] in (1, 2), call.function.arguments
            args, depth = args.get("next"), depth + 1
        depths.append(depth)
    assert max(depths) >= 2, depths  # the recursion was taken at least once


@pytest.mark.parametrize(
    "parameters",
    [{"type": "string"}, {"type": ["object", "null"]}, {"properties": {"a": {"type": "string"}}}, [1]],
    ids=["string", "type-list", "no-type", "not-a-dict"],
)
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_parameters_that_are_not_an_object_schema_are_400(server, parameters, tool_choice):
    """Arguments are always a JSON object (OpenAI refuses other parameter schemas); a string schema
    used to be accepted, and a forced call's ``arguments`` came back as a bare string."""
    bad = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER_TOOL, bad], tool_choice=tool_choice, max_tokens=5
        )
    assert err.value.body["param"] == "tools.1.function.parameters", err.value.body
    assert "object" in err.value.body["message"]


@pytest.mark.parametrize("parameters", [None, {}], ids=["absent", "empty"])
def test_function_without_parameters_gets_empty_arguments(server, parameters):
    fn: dict[str, Any] = {"name": "ping"}
    if parameters is not None:
        fn["parameters"] = parameters
    r = server.client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[{"type": "function", "function": fn}],
        tool_choice={"type": "function", "function": {"name": "ping"}},
        temperature=1.0,
        seed=2,
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


# ---------------------------------------------------------------------------------------- item: limits
MANY_RULES = "start: " + " | ".join(json.dumps(f"w{i}") for i in range(2500))
# Recursion without a way out: llguidance's "Too many items" once the first token is taken.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def test_grammar_library_limits_are_400_before_queueing(server):
    """Limits llguidance reports only while computing a mask (was: a 500, or a request that emitted a
    token or two and ended with ``finish_reason="error"``)."""
    cases = [
        (dict(extra_body={"guided_grammar": MANY_RULES}), "guided_grammar", "max is 2000"),
        (dict(extra_body={"guided_json": {"$ref": "#"}}), "guided_json", "matches no output"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}),
            "response_format",
            "Too many items",
        ),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "loop", "parameters": ENDLESS}}],
                tool_choice="required",
            ),
            "tool_choice",
            "Too many items",
        ),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **kwargs)
        assert err.value.body["param"] == param, err.value.body
        assert words in err.value.body["message"], err.value.body
    plain = server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert plain.choices[0].finish_reason == "length"  # the server still serves


@pytest.mark.parametrize("stream", [False, True])
def test_long_choice_lists_are_served(server, stream):
    """2,500 options (was: past llguidance's 2,000 items per Earley row, a 500)."""
    options = [f"option {i}" for i in range(2500)]
    kw = dict(model="tiny", prompt="pick:", max_tokens=20, temperature=1.0, seed=4, n=2)
    kw["extra_body"] = {"guided_choice": options}
    if stream:
        texts: dict[int, str] = {}
        for chunk in server.client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        outputs = list(texts.values())
    else:
        r = server.client.completions.create(**kw)
        assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
        outputs = [c.text for c in r.choices]
    assert len(outputs) == 2 and all(text in options for text in outputs), outputs


# ---------------------------------------------------------------------------------------- item: start
def test_grammar_backend_is_built_when_the_server_starts():
    """The tokenizer's preparation for the grammar library (about a second for a real vocabulary)
    happens at start, off the event loop: the first constrained request finds it done and does not
    stall the other connections."""
    llm = LLM(make_model("llama"), make_tokenizer(), num_blocks=64)
    structured = llm.engine.structured
    assert not structured.ready  # an engine alone still builds it lazily
    server = _Server(llm, "tiny")
    try:
        assert structured.ready
        backend = structured.backend
        out = server.client.completions.create(
            model="tiny", prompt="pick:", max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
        )
        assert out.choices[0].text in ("yes", "no")
        assert structured.backend is backend  # not rebuilt by the request
    finally:
        server.close()


def test_server_starts_without_a_usable_grammar_backend():
    """A tokenizer the grammar library cannot read: the server still starts, and a constrained
    request is the 400 it was."""
    llm = LLM(make_model("llama"), make_tokenizer(), num_blocks=64)
    structured = llm.engine.structured
    structured.tokenizer = object()  # not a Hugging Face fast tokenizer
    server = _Server(llm, "tiny")
    try:
        assert not structured.ready
        with pytest.raises(openai.BadRequestError, match="fast tokenizer"):
            server.client.completions.create(
                model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "[0-9]"}
            )
        plain = server.client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert plain.choices[0].finish_reason == "length"
    finally:
        server.close()
