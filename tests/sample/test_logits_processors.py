"""Custom batch logits processors: the built-ins, the once-per-step contract, failure isolation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from cbgen.request import Request
from cbgen.sample.logits_processors import AllowedTokensProcessor, BadWordsProcessor, BatchLogitsProcessor
from cbgen.sample.sampler import Sampler
from cbgen.sampling_params import SamplingParams


def make_request(params: SamplingParams, output=(), prompt=(5, 6)) -> Request:
    req = Request(request_id="r", prompt_token_ids=list(prompt), params=params, eos_token_ids=frozenset({2}))
    for t in output:
        req.append_token(t)
    return req


class CountingProcessor:
    """Keeps only the token named by the row's arg; raises for arg "boom"; counts its calls."""

    name = "only"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(
        self, logits: torch.Tensor, rows: torch.Tensor, args: list[Any], requests: Sequence[Request]
    ):
        self.calls.append(rows.tolist())
        assert logits.shape[0] == len(args) == len(requests) == rows.numel()
        out = torch.full_like(logits, float("-inf"))
        for j, arg in enumerate(args):
            if arg == "boom":
                raise RuntimeError("exploded")
            out[j, arg] = 0.0
        return out


def test_protocol_is_satisfied() -> None:
    assert isinstance(AllowedTokensProcessor(), BatchLogitsProcessor)
    assert isinstance(BadWordsProcessor(), BatchLogitsProcessor)
    assert isinstance(CountingProcessor(), BatchLogitsProcessor)


def test_called_once_per_step_with_only_its_rows() -> None:
    proc = CountingProcessor()
    sampler = Sampler(20, [proc])
    reqs = [
        make_request(SamplingParams()),
        make_request(SamplingParams(logits_processor_args={"only": 7})),
        make_request(SamplingParams(temperature=0, logits_processor_args={"only": 3})),
        make_request(SamplingParams()),
    ]
    out = sampler(torch.randn(4, 20), reqs)
    assert proc.calls == [[1, 2]]
    assert out.token_ids[1].item() == 7 and out.token_ids[2].item() == 3
    assert out.logprobs[1].item() == pytest.approx(0.0, abs=1e-6)  # point mass after the processor
    assert out.failed == {}


def test_failure_isolation() -> None:
    proc = CountingProcessor()
    sampler = Sampler(20, [proc, AllowedTokensProcessor()])
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    reqs = [
        make_request(SamplingParams(logits_processor_args={"only": 4})),
        make_request(SamplingParams(logits_processor_args={"only": "boom"})),
        make_request(SamplingParams(top_k=3, logits_processor_args={"only": 11})),
        make_request(SamplingParams(logits_processor_args={"nope": 1})),
        make_request(SamplingParams(logits_processor_args={"allowed_token_ids": [1, 2]})),
    ]
    out = sampler(logits, reqs)
    assert set(out.failed) == {1, 3}
    assert "only" in out.failed[1] and "RuntimeError" in out.failed[1] and "exploded" in out.failed[1]
    assert "nope" in out.failed[3]
    assert out.token_ids[0].item() == 4 and out.token_ids[2].item() == 11
    assert out.token_ids[4].item() in (1, 2)
    # One batched call that raised, then one retry per row.
    assert proc.calls == [[0, 1, 2], [0], [1], [2]]


def test_wrong_output_shape_fails_rows() -> None:
    class Bad:
        name = "bad"

        def __call__(self, logits, rows, args, requests):
            return logits[:, :-1]

    out = Sampler(10, [Bad()])(
        torch.randn(2, 10), [make_request(SamplingParams(logits_processor_args={"bad": 0}))] * 2
    )
    assert set(out.failed) == {0, 1}
    assert "shape" in out.failed[0]


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler(10, [AllowedTokensProcessor(), AllowedTokensProcessor()])


def test_allowed_tokens_distribution_and_logprobs() -> None:
    vocab = 40
    n = 20_000
    logits = torch.from_numpy((np.random.RandomState(1).randn(vocab) * 1.5).astype(np.float32))
    allowed = [3, 9, 17, 33, 39, 500]  # 500 is outside the vocabulary and ignored
    req = make_request(SamplingParams(logits_processor_args={"allowed_token_ids": allowed}))
    out = Sampler(vocab, [AllowedTokensProcessor()])(logits.expand(n, -1).contiguous(), [req] * n)
    assert out.failed == {}
    counts = np.bincount(out.token_ids.numpy(), minlength=vocab)
    ids = allowed[:-1]
    assert counts.sum() == counts[ids].sum()
    x = logits.double().numpy()[ids]
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    expected = probs * n
    chi2 = ((counts[ids] - expected) ** 2 / expected).sum()
    assert chi2 < 20.0  # 4 dof, p ~ 5e-4
    # Temperature 1, no penalties: logprob = raw - log(mass of the allowed tokens).
    raw = torch.log_softmax(logits.double(), 0)
    kept = torch.logsumexp(raw[ids], 0).item()
    assert np.allclose(out.log_kept_mass.numpy(), kept, atol=1e-5)
    torch.testing.assert_close(out.logprobs, out.raw_logprobs - out.log_kept_mass, atol=1e-5, rtol=0)


def test_allowed_tokens_rejects_bad_args() -> None:
    sampler = Sampler(10, [AllowedTokensProcessor()])
    reqs = [
        make_request(SamplingParams(logits_processor_args={"allowed_token_ids": []})),
        make_request(SamplingParams(logits_processor_args={"allowed_token_ids": "abc"})),
        make_request(SamplingParams(logits_processor_args={"allowed_token_ids": [4]})),
    ]
    out = sampler(torch.randn(3, 10), reqs)
    assert set(out.failed) == {0, 1}
    assert out.token_ids[2].item() == 4


def test_bad_words() -> None:
    vocab = 12
    proc = BadWordsProcessor()
    logits = torch.zeros(4, vocab)
    words = [[7], [1, 2, 3], [4, 5]]
    reqs = [
        make_request(SamplingParams(), output=[9, 1, 2]),  # ends with [1, 2] -> ban 3
        make_request(SamplingParams(), output=[4]),  # ends with [4] -> ban 5
        make_request(SamplingParams(), output=[1, 2, 0]),  # no prefix matches
        make_request(SamplingParams(), output=[], prompt=[1, 2]),  # the prompt does not count
    ]
    out = proc(logits.clone(), torch.arange(4), [words] * 4, reqs)
    banned = [set(torch.nonzero(torch.isinf(out[i])).flatten().tolist()) for i in range(4)]
    assert banned == [{7, 3}, {7, 5}, {7}, {7}]


def test_bad_words_through_sampler() -> None:
    vocab = 12
    logits = torch.zeros(vocab)
    logits[3] = 10.0
    logits[8] = 9.0
    req = make_request(
        SamplingParams(temperature=0, logits_processor_args={"bad_words": [[1, 2, 3]]}), output=[1, 2]
    )
    ok = make_request(
        SamplingParams(temperature=0, logits_processor_args={"bad_words": [[1, 2, 3]]}), output=[1]
    )
    out = Sampler(vocab, [BadWordsProcessor()])(logits.expand(2, -1).contiguous(), [req, ok])
    assert out.token_ids.tolist() == [8, 3]


# ---------------------------------------------------------------------------------------------- validation
# bad_words and logit_bias are checked before a request runs: nothing in them may fail in the sampler.


@pytest.mark.parametrize(
    "words",
    [
        "mat",  # a bare string, not a list of words
        [[]],
        [[-1]],
        [[1, 2.0]],
        [[True]],
        [""],
        ["   "],
        [b"mat"],
        [7],
    ],
)
def test_bad_words_refused_when_built(words) -> None:
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(logits_processor_args={"bad_words": words})


def test_bad_words_normalised_without_touching_the_callers_dict() -> None:
    args = {"bad_words": [(np.int64(3), 4)], "other": 1}
    params = SamplingParams(logits_processor_args=args)
    assert params.logits_processor_args == {"bad_words": [[3, 4]], "other": 1}
    assert type(params.logits_processor_args["bad_words"][0][0]) is int
    assert args == {"bad_words": [(np.int64(3), 4)], "other": 1}


def test_bad_word_strings_without_tokenizer_refused_at_validation() -> None:
    params = SamplingParams(logits_processor_args={"bad_words": [" mat", [5]]})
    with pytest.raises(ValueError, match=r"bad_words.*strings need a tokenizer.*token-id"):
        params.verify_for_model(100, 5)
    assert params.logits_processor_args == {"bad_words": [" mat", [5]]}  # nothing changed


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    from cbgen import LLM
    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(smollm2_path, dtype=torch.float32)
    return LLM(model, tokenizer, block_size=16)


CAT = "The cat sat on the"  # SmolLM2 continues greedily with " cat's back, and the"


def _first_tokens(llm, params: SamplingParams) -> list[int]:
    out = llm.generate(CAT, params, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].text
    return out.outputs[0].token_ids


@pytest.mark.slow
def test_bad_word_strings_resolve_like_vllm(smollm2_llm) -> None:
    """With the tokenizer, each string becomes its bare and its space-prefixed spelling."""
    tok = smollm2_llm.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    params = SamplingParams(
        temperature=0, max_tokens=3, logits_processor_args={"bad_words": ["cat's", "  cat", [5, 6]]}
    )
    params.verify_for_model(len(tok), 5, tokenizer=tok)
    want = [enc("cat's"), enc(" cat's"), enc("cat"), enc(" cat"), [5, 6]]
    assert params.logits_processor_args["bad_words"] == want
    assert len(enc(" cat's")) == 2 and enc(" cat") == enc(" cat's")[:1]

    # Through the engine: the free continuation starts " cat" "'s"; banning " cat" changes the first
    # token, banning "cat's" only the second (its last token after its prefix).
    free = _first_tokens(smollm2_llm, SamplingParams(temperature=0, max_tokens=3))
    assert free[:2] == enc(" cat's")
    for words, same_prefix in ((["cat"], 0), (["cat's"], 1)):
        params = SamplingParams(temperature=0, max_tokens=3, logits_processor_args={"bad_words": words})
        params.verify_for_model(len(tok), 5, tokenizer=tok)
        got = _first_tokens(smollm2_llm, params)
        assert got[:same_prefix] == free[:same_prefix] and got[same_prefix] != free[same_prefix]


@pytest.mark.slow
def test_bad_word_strings_never_fail_at_run_time(smollm2_llm) -> None:
    """vLLM's string form through LLM: refused before anything runs while the engine does not hand
    its tokenizer to validation, honoured once it does; never an empty, failed sample."""
    params = SamplingParams(temperature=0, max_tokens=3, logits_processor_args={"bad_words": ["cat"]})
    try:
        got = _first_tokens(smollm2_llm, params)
    except ValueError as exc:
        assert "bad_words" in str(exc) and "token-id" in str(exc)
        assert not smollm2_llm.engine.has_unfinished()
    else:
        assert got[0] not in smollm2_llm.tokenizer.encode(" cat", add_special_tokens=False)


@pytest.mark.parametrize(
    "key",
    [
        "\u0661\u0662",  # Arabic-Indic "12": str.isdecimal() says yes, int() reads 12
        "\uff11\uff12",  # fullwidth "12"
        "-5",
        "+5",
        " 5",
        "5.0",
        "",
        "9" * 5000,  # int() itself would refuse it, with its own message
        1.0,
        True,
    ],
)
def test_logit_bias_keys_are_ascii_digit_token_ids(key) -> None:
    with pytest.raises(ValueError, match=r"logit_bias: key .* is not a token id"):
        SamplingParams(logit_bias={key: 1.0})


def test_logit_bias_accepts_integers_and_ascii_digit_strings() -> None:
    params = SamplingParams(logit_bias={"12": 1, "007": -2.5, np.int64(3): -math.inf, 4: 0})
    assert params.logit_bias == {12: 1.0, 7: -2.5, 3: -math.inf, 4: 0.0}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logit_bias={"\ud800": 1}),
        dict(logit_bias={"\udfff" * 10_000: 1}),
        dict(logit_bias={str(i): 1 for i in range(10_000)} | {"x\ud800": 1}),
        dict(stop=["ok", 5]),
        dict(logits_processor_args={"bad_words": [["\ud800" * 1000]]}),
    ],
)
def test_validation_messages_are_bounded_and_encodable(kwargs) -> None:
    """User strings are quoted escaped and cut short: a lone surrogate in a JSON key must give a
    400 whose message can be sent, not a 500 while encoding it."""
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    message.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    assert message.isascii() and len(message) < 400
