"""Structured output through the engine: JSON schema, JSON object, regex, choice and Lark grammar.

The oracle for the masks is a plain loop: one HF forward per token, the grammar's mask applied to
that row alone, argmax, and the matcher told about the token.  The engine must produce the same
tokens while it batches, chunks, preempts, overlaps steps, forks n>1 samples and restarts requests
after a weight change, so every one of those paths keeps each sequence's matcher in step.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.sample.structured.llguidance_backend import LLGuidanceBackend
from cbgen.structured_params import StructuredOutputParams
from extras import require_extra
from structured_helpers import PERSON_SCHEMA, schema_errors
from tiny_models import make_model, make_prompts
from tiny_tokenizer import make_tokenizer

require_extra("llguidance")  # cbgen's backend imports without it; the tests need it

EOS = 2
# Every string bounded and no free-form keys: a random model must still finish within max_tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "sub": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "tags", "sub"],
    "additionalProperties": False,
}
JSON = {"json": SMALL_SCHEMA}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def _reference(model, tok, prompt: list[int], spec: dict, max_tokens: int) -> list[int]:
    """Constrained greedy decoding, one token at a time, with no batching at all."""
    backend = LLGuidanceBackend(tok, 512, [EOS])
    matcher = backend.new_matcher(backend.compile(StructuredOutputParams(**spec)))
    ids, out = list(prompt), []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        bitmask = torch.full((1, 16), -1, dtype=torch.int32)
        backend.fill([(matcher, 0)], bitmask)
        allowed = ((bitmask[0].unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume([token])
        ids.append(token)
    return out


def _greedy(spec: dict, max_tokens: int = 40, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, structured_output=spec)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),
        # Small cache and budget: chunked prompts, preemptions, overlapped steps.
        dict(block_size=8, num_blocks=24, max_num_batched_tokens=24, async_scheduling=True),
    ],
    ids=["sync", "async-preempt"],
)
def test_constrained_greedy_matches_one_token_at_a_time(model, tok, engine_kwargs):
    prompts = make_prompts(8, lengths=(3, 40), seed=5)
    specs = [JSON, {"regex": "[a-z]{2,5}-[0-9]{1,3}"}, {"choice": ["red", "green", "blue"]}, JSON]
    llm = LLM(model, tok, **{"num_blocks": 256, **engine_kwargs})
    params = [_greedy(specs[i % len(specs)]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if engine_kwargs:
        assert llm.stats.preemptions > 0, "setup: the small cache should preempt"
    for prompt, p, out in zip(prompts, params, outs):
        spec = {p.structured_output.kind: getattr(p.structured_output, p.structured_output.kind)}
        ref = _reference(model, tok, prompt, spec, 40)
        got = out.outputs[0].token_ids
        assert got == ref, (spec, tok.decode(got), tok.decode(ref))
    assert llm.engine.block_manager.num_used_blocks == 0


def test_every_kind_gives_valid_output(model, tok):
    llm = LLM(model, tok, num_blocks=256)
    cases = [
        ({"json": SMALL_SCHEMA}, lambda t: not schema_errors(json.loads(t), SMALL_SCHEMA)),
        ({"json": json.dumps(SMALL_SCHEMA)}, lambda t: not schema_errors(json.loads(t), SMALL_SCHEMA)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"regex": r"[a-z]{3,6}@[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3,6}@[0-9]{2}", t)),
        ({"choice": ["yes", "no", 'it "depends"']}, lambda t: t in ("yes", "no", 'it "depends"')),
        (
            {"grammar": 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'},
            lambda t: re.fullmatch(r"x=\d{1,3}(,\d{1,3})*", t),
        ),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=80, structured_output=spec)
        for i, (spec, _) in enumerate(cases)
    ]
    outs = llm.generate([[5, 6, 7, 8]] * len(cases), params, use_tqdm=False)
    for (spec, valid), out in zip(cases, outs):
        for sample in out.outputs:
            if spec.get("json_object") and sample.finish_reason == "length":
                continue  # any object: a random model may write keys until max_tokens
            assert sample.finish_reason == "stop", (spec, sample.text)
            assert valid(sample.text), (spec, sample.text)


def test_unconstrained_rows_are_untouched(model, tok):
    """Seeded and greedy rows without a constraint give the same tokens whether or not constrained
    rows share their batch (logprobs to fp32 rounding: the forward's batch shapes differ; the
    sampler-level test in tests/sample/test_structured.py checks the rows bit for bit)."""
    prompts = make_prompts(6, lengths=(4, 30), seed=9)
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=24, ignore_eos=True),
    ]
    alone = LLM(model, tok, num_blocks=256).generate(prompts[:3], free, use_tqdm=False)
    mixed_params = [*free, _greedy(JSON), _greedy({"choice": ["a", "b"]}), _greedy(JSON)]
    mixed = LLM(model, tok, num_blocks=256).generate(prompts, mixed_params, use_tqdm=False)
    for a, b in zip(alone, mixed[:3]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert x.token_logprobs == pytest.approx(y.token_logprobs, abs=1e-5)
            assert x.raw_logprobs == pytest.approx(y.raw_logprobs, abs=1e-5)


def test_finished_grammar_allows_only_eos(model, tok):
    out = (
        LLM(model, tok, num_blocks=64)
        .generate(
            [[5, 6, 7]],
            SamplingParams(
                temperature=1.0, seed=0, max_tokens=20, logprobs=5, structured_output={"choice": ["yes"]}
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
    )
    assert out.text == "yes" and out.finish_reason == "stop"
    assert out.token_ids[-1] == EOS
    # The step that chose EOS had nothing else to choose from: every other token was masked.
    assert list(out.top_logprobs[-1]) == [EOS] and out.top_logprobs[-1][EOS] == pytest.approx(0.0)


def test_n_samples_fork_and_waves_keep_their_own_matchers(model, tok):
    """n=6 seeded samples: forked off one prefill, or (max_num_seqs=2) mostly queued as sequences of
    their own that recompute the prompt.  Same tokens either way, all valid."""
    params = SamplingParams(temperature=1.0, seed=11, n=6, max_tokens=60, structured_output=JSON)
    forked = LLM(model, tok, num_blocks=256).generate([[9, 8, 7, 6]], params, use_tqdm=False)[0]
    waves = LLM(model, tok, num_blocks=256, max_num_seqs=2).generate([[9, 8, 7, 6]], params, use_tqdm=False)[
        0
    ]
    texts = [s.text for s in forked.outputs]
    assert len(set(texts)) > 1, "setup: seeded samples should differ"
    assert texts == [s.text for s in waves.outputs]
    for text in texts:
        assert not schema_errors(json.loads(text), SMALL_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_weight_change_mid_generation(model, tok, stream):
    """A restarted group gets fresh matchers (its outputs equal a run under the new weights alone);
    a streamed one keeps its tokens and its matcher, and still ends valid."""
    model = copy.deepcopy(model)
    prompts = make_prompts(3, lengths=(4, 20), seed=2)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=60, structured_output=JSON)
    llm = LLM(model, tok, num_blocks=256)
    ids = [llm.engine.add_request(p, params, stream=stream) for p in prompts]
    texts: dict[str, list[str]] = {i: ["", ""] for i in ids}

    def collect(outputs):
        for out in outputs:
            for c in out.outputs:
                if stream:
                    texts[out.request_id][c.index] += c.text
                elif out.finished:
                    texts[out.request_id][c.index] = c.text

    for _ in range(6):
        collect(llm.engine.step())
    assert any(s.structured_state is not None for g in llm.engine.groups.values() for s in g.samples)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    while llm.engine.has_unfinished():
        collect(llm.engine.step())
    assert llm.weight_version == 1
    for i in ids:
        for text in texts[i]:
            assert not schema_errors(json.loads(text), SMALL_SCHEMA), text
    if not stream:
        fresh = LLM(model, tok, num_blocks=256).generate(prompts, params, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in fresh] == [texts[i] for i in ids]


def test_invalid_constraints_are_refused_before_anything_is_queued(model, tok):
    llm = LLM(model, tok, num_blocks=64)
    good = SamplingParams(max_tokens=8, structured_output=JSON)
    bad = [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "nonsense"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ]
    for spec, words in bad:
        with pytest.raises(ValueError, match=words):
            llm.generate([[5, 6], [7, 8]], [good, SamplingParams(structured_output=spec)], use_tqdm=False)
        assert llm.engine.num_unfinished == 0
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.generate([[5, 6]], SamplingParams(ignore_eos=True, structured_output=JSON), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model, num_blocks=16).generate([[5, 6]], good, use_tqdm=False)
    for shape in ({}, {"json": JSON["json"], "regex": "a"}, {"choice": []}, {"jsn": {}}, {"json": "{no"}):
        with pytest.raises(ValueError, match="structured_output"):
            SamplingParams(structured_output=shape)


def test_grammar_library_limits_are_refused_before_anything_is_queued(model, tok):
    """Limits llguidance reports only while masking (was: the request emitted a token or two and
    ended with finish_reason="error"); a long choice list, which used to hit one, now works."""
    llm = LLM(model, tok, num_blocks=64)
    good = SamplingParams(max_tokens=8, structured_output=JSON)
    many_rules = "start: " + " | ".join(json.dumps(f"w{i}") for i in range(2500))
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    bad = [
        ({"grammar": many_rules}, "max is 2000"),
        ({"json": endless}, "Too many items"),
        ({"json": {"$ref": "#"}}, "matches no output"),
    ]
    for spec, words in bad:
        with pytest.raises(ValueError, match=words):
            llm.generate([[5, 6], [7, 8]], [good, SamplingParams(structured_output=spec)], use_tqdm=False)
        assert llm.engine.num_unfinished == 0
        with pytest.raises(ValueError, match=words):
            llm.add_requests([[5, 6]], SamplingParams(structured_output=spec))
        assert llm.engine.num_unfinished == 0
    options = [f"w{i}" for i in range(2500)]
    params = SamplingParams(
        temperature=1.0, seed=0, n=3, max_tokens=10, structured_output={"choice": options}
    )
    (out,) = llm.generate([[5, 6]], params, use_tqdm=False)
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
    assert all(c.text in options for c in out.outputs), [c.text for c in out.outputs]


@pytest.mark.slow
def test_smollm2_64_of_64_valid(smollm2_path):
    """The real model, a nested schema with an enum and an array, 64 chat prompts, sampled."""
    llm = LLM(str(smollm2_path))
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(64)
    ]
    params = SamplingParams(
        temperature=0.7, seed=0, max_tokens=160, structured_output={"json": PERSON_SCHEMA}
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs if _invalid(o.outputs[0].text)]
    assert not bad, bad
    assert len({o.outputs[0].text for o in outs}) > 32


def _invalid(text: str) -> bool:
    try:
        return bool(schema_errors(json.loads(text), PERSON_SCHEMA))
    except ValueError:
        return True
