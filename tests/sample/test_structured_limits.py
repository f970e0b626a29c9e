"""The grammar library's limits are found when a constraint is compiled, not in a running request.

llguidance reports some limits only while computing a mask (an Earley row past 2,000 items, a step
past 50,000, a grammar that matches nothing); the backend's compile computes the masks of the first
tokens to find them.  Checked on the tiny tokenizer, through ``StructuredOutputs`` (what
``Engine.validate`` calls) and the backend.
"""

from __future__ import annotations

import json

import pytest
import torch

from cbgen.request import Request
from cbgen.sample.structured import StructuredOutputs
from cbgen.sampling_params import SamplingParams
from cbgen.structured_params import StructuredOutputParams
from extras import require_extra
from tiny_tokenizer import make_tokenizer

require_extra("llguidance")

EOS = 2
MANY_RULES = "start: " + " | ".join(json.dumps(f"w{i}") for i in range(2500))
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def structured() -> StructuredOutputs:
    return StructuredOutputs(make_tokenizer(), 512, [EOS])


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"grammar": MANY_RULES}, "after 1 token.*max is 2000"),
        ({"json": ENDLESS}, "after 1 token.*Too many items"),
        ({"json": {"$ref": "#"}}, "matches no output"),
        ({"json": {"allOf": [{"$ref": "#"}]}}, "matches no output"),
    ],
    ids=["row-items", "step-items", "empty", "empty-allof"],
)
def test_limits_reported_while_masking_are_compile_errors(structured, spec, words):
    with pytest.raises(ValueError, match=f"structured_output.{next(iter(spec))}: .*{words}"):
        structured.validate(SamplingParams(structured_output=spec))


def _walk(structured: StructuredOutputs, spec: dict, pick: int) -> str:
    """Text of the path that always takes allowed token number ``pick`` (from the end if negative)."""
    req = Request("r", [5], SamplingParams(structured_output=spec), frozenset({EOS}))
    for _ in range(60):
        logits = torch.zeros(1, 512)
        failed: dict[int, str] = {}
        structured.apply(logits, [0], [req], failed)
        assert not failed, failed
        allowed = logits[0].isfinite().nonzero().flatten().tolist()
        token = allowed[pick % len(allowed)] if allowed != [EOS] else EOS
        if token == EOS:
            return structured.tokenizer.decode(req.output_token_ids)
        req.append_token(token)
    raise AssertionError("no EOS in 60 tokens")


def test_long_choice_lists_compile_and_match_exactly_one_option(structured):
    """Past llguidance's 2,000 items per row: the options are one lexer terminal, not 2,500 rules."""
    options = [f"w{i}" for i in range(2500)] + ["w1x", "a b"]
    spec = {"choice": options}
    structured.validate(SamplingParams(structured_output=spec))
    assert {_walk(structured, spec, pick) for pick in (0, 1, -1, -2)} <= set(options)
    assert _walk(structured, {"choice": ["a", "ab", "abc"]}, -1) in ("a", "ab", "abc")


def test_probe_leaves_the_compiled_grammar_at_its_start(structured):
    """The probe walks copies: a matcher made from the compiled grammar accepts a whole output."""
    spec = StructuredOutputParams(json={"type": "object", "properties": {"k": {"enum": ["x", "y"]}}})
    matcher = structured.backend.new_matcher(structured.compiled(spec))
    ids = structured.tokenizer.encode('{"k": "y"}', add_special_tokens=False)
    assert matcher.consume(ids) and matcher.inner.is_accepting(), matcher.error()


def test_prepare_builds_the_backend_once_and_never_raises():
    so = StructuredOutputs(make_tokenizer(), 512, [EOS])
    assert not so.ready
    assert so.prepare() and so.ready
    backend = so.backend
    assert so.prepare() and so.backend is backend
    for broken in (StructuredOutputs(None, 512, [EOS]), StructuredOutputs(object(), 512, [EOS])):
        assert not broken.prepare() and not broken.ready
        with pytest.raises(ValueError):  # the request that needs it says why, as before
            broken.validate(SamplingParams(structured_output={"regex": "a"}))
