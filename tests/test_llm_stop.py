"""Stop strings and stop tokens on the real tokenizer, with vLLM's semantics: stop strings matched
across token boundaries and cut correctly, ``min_tokens`` holding back stop strings as well as stop
tokens, a stop token's text left out of the output, and streams that add up to the final text."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "Count from one to fifty, separated by commas: one, two, three,"
# SmolLM2's greedy continuation of COUNT, one token per piece.
COUNT_PIECES = [" four", ",", " five", ",", " six", ",", " seven", ",", " eight", ",", " nine", ","]
PERIOD = 30  # SmolLM2's "." token


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(smollm2_path, dtype=torch.float32)
    return LLM(model, tokenizer, block_size=16)


@pytest.fixture(scope="module")
def async_llm(llm):
    """The same model under overlap scheduling (stop checks one step late)."""
    return LLM(llm.model, llm.tokenizer, block_size=16, async_scheduling=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_answer_and_stop_string_spanning_tokens(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    full = llm.chat(QUESTION, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "capital of France is Paris" in full.text
    ids = full.token_ids
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    # choose a stop string made of the end of one token and the start of the next
    i = next(k for k, p in enumerate(pieces) if p.strip() == "France")
    stop = pieces[i - 1][-2:] + pieces[i][:3]
    assert len(stop) == 5 and stop in full.text

    cut = llm.chat(QUESTION, SamplingParams(max_tokens=20, temperature=0, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == ids[: i + 1], "generation stops at the token that completes the stop string"

    kept = llm.chat(
        QUESTION,
        SamplingParams(max_tokens=20, temperature=0, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eos_ends_generation_and_is_not_in_text(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    out = llm.chat(QUESTION, SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "<|im_end|>" not in out.text
    # Like vLLM: the stop token's text is not part of the output, even when special tokens are kept
    # (its id stays in token_ids), unless include_stop_str_in_output.
    raw = llm.chat(
        QUESTION, SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False), use_tqdm=False
    )[0].outputs[0]
    assert raw.token_ids == out.token_ids and raw.text == out.text
    kept = llm.chat(
        QUESTION,
        SamplingParams(
            max_tokens=200, temperature=0, skip_special_tokens=False, include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == out.text + "<|im_end|>"


def test_smollm2_raw_logprobs_match_plain_forward(llm):
    """raw_logprob is the temperature-1 log-softmax of the unmodified model: a plain fp32 forward over
    prompt + completion reproduces it for every sampled token."""
    prompt = llm.tokenizer.apply_chat_template(
        QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    out = llm.generate([list(prompt)], params, use_tqdm=False)[0]
    for c in out.outputs:
        ids = torch.tensor([list(prompt) + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(llm.model(ids).logits[0].double(), -1)
        ref = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.raw_logprobs, ref)) < 1e-4


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 20, **kwargs})


def _question_ids(llm) -> list[int]:
    return list(
        llm.tokenizer.apply_chat_template(
            QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )


def _count_tokens(llm) -> tuple[list[int], list[int]]:
    """COUNT's prompt ids and free greedy continuation, checked against COUNT_PIECES (the tests'
    premise)."""
    free = llm.generate(COUNT, _greedy(), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    assert [llm.tokenizer.decode([t]) for t in tokens[: len(COUNT_PIECES)]] == COUNT_PIECES
    return free.prompt_token_ids, tokens


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_min_tokens_holds_back_stop_strings(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    _, tokens = _count_tokens(llm)

    def run(**kwargs):
        return llm.generate(COUNT, _greedy(**{"stop": [", "], **kwargs}), use_tqdm=False)[0].outputs[0]

    out = run()
    assert (out.text, out.token_ids) == (" four", tokens[:3])
    # The text of the first 8 tokens (" four, five, six, seven,") cannot complete a stop string.
    # Token 9 (" eight") completes the ", " that began with token 8's comma, and that counts: the
    # request ends at token min_tokens + 1, where a stop token could end it too.
    out = run(min_tokens=8)
    assert (out.text, out.token_ids) == (" four, five, six, seven", tokens[:9])
    assert (out.finish_reason, out.stop_reason) == ("stop", ", ")
    kept = run(min_tokens=8, include_stop_str_in_output=True)
    assert (kept.text, kept.token_ids) == (" four, five, six, seven, ", tokens[:9])
    # min_tokens=9 covers that whole ", " too; the next one is completed by token 11 (" nine").
    out = run(min_tokens=9)
    assert (out.text, out.token_ids, out.finish_reason) == (
        " four, five, six, seven, eight",
        tokens[:11],
        "stop",
    )
    # A stop string that is never completed after min_tokens: the request runs to max_tokens.
    out = run(min_tokens=4, stop=["four"], max_tokens=12)
    assert (out.token_ids, out.finish_reason) == (tokens[:12], "length")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_stop_token_text_is_left_out(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    free = llm.chat(QUESTION, _greedy(max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert free.text.endswith("Paris.") and free.token_ids[-2] == PERIOD
    out = llm.chat(QUESTION, _greedy(max_tokens=200, stop_token_ids=[PERIOD]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", PERIOD)
    assert out.token_ids == free.token_ids[:-1], "the stop token's id stays in token_ids"
    assert out.text == free.text[:-1]
    # The same with stop strings set (text built incrementally instead of decoded at the end).
    out = llm.chat(
        QUESTION, _greedy(max_tokens=200, stop_token_ids=[PERIOD], stop=["never"]), use_tqdm=False
    )[0].outputs[0]
    assert (out.text, out.token_ids) == (free.text[:-1], free.token_ids[:-1])
    kept = llm.chat(
        QUESTION,
        _greedy(max_tokens=200, stop_token_ids=[PERIOD], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == free.text


def _stream(llm, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], list[str], str | None]:
    """Runs one streamed request on the engine: (joined text, joined token ids, deltas, finish reason)."""
    engine = llm.engine
    rid = engine.add_request(prompt, params, stream=True)
    deltas: list[str] = []
    tokens: list[int] = []
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
                finish = out.outputs[0].finish_reason
    return "".join(deltas), tokens, deltas, finish


STREAM_CASES = {
    "stop_token": dict(stop_token_ids=[PERIOD]),
    "stop_token_kept": dict(stop_token_ids=[PERIOD], include_stop_str_in_output=True),
    "eos_special_kept": dict(skip_special_tokens=False),
    "eos_special_kept_with_stop_strings": dict(skip_special_tokens=False, stop=["never", "xyz"]),
    "eos_included": dict(skip_special_tokens=False, include_stop_str_in_output=True),
    "stop_token_with_stop_strings": dict(stop_token_ids=[PERIOD], stop=["Paris!"]),
}


# Every case in sync mode; under overlap scheduling one per kind of text building (decoded at the end,
# incremental with stop strings), which is where the one-step-late stop check could leak a token.
STREAM_RUNS = [("sync", case) for case in sorted(STREAM_CASES)] + [
    ("async", "stop_token"),
    ("async", "eos_special_kept_with_stop_strings"),
]


@pytest.mark.parametrize(("mode", "case"), STREAM_RUNS)
def test_stream_adds_up_to_the_final_text(llm, async_llm, mode, case):
    llm = async_llm if mode == "async" else llm
    params = _greedy(max_tokens=200, **STREAM_CASES[case])
    final = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    text, tokens, deltas, finish = _stream(llm, _question_ids(llm), params)
    assert final.finish_reason == "stop"
    assert (text, tokens, finish) == (final.text, final.token_ids, "stop")
    assert len(deltas) > 3, "the text really came in pieces"
    if params.include_stop_str_in_output:
        assert final.text.endswith("." if params.stop_token_ids else "<|im_end|>")
    else:
        assert final.text.endswith("Paris") if params.stop_token_ids else final.text.endswith("Paris.")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_stream_with_min_tokens_and_stop_string(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    prompt, tokens = _count_tokens(llm)
    text, got, deltas, finish = _stream(llm, prompt, _greedy(stop=[", "], min_tokens=8))
    assert (text, got, finish) == (" four, five, six, seven", tokens[:9], "stop")
    assert len(deltas) > 3
