"""Incremental detokenisation and stop strings, on the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.detokenizer import IncrementalDetokenizer, StopStringMatcher

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    """SmolLM2's tokenizer, from the converted model folder.  There is no stand-in: a toy tokenizer
    would pass these tests without saying that the real one was never tried."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path), local_files_only=True)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>", "not SmolLM2's tokenizer"
    return tok


def interesting_ids(tokenizer) -> list[int]:
    """Tokens that split multi-byte characters, plus special tokens and plain words."""
    text = "Hello wörld 日本語 🤖🤖 naïve café — ünïcödé ✓ 😀 x\n\ty ßü 中文字符"
    return sorted(set(tokenizer.encode(text, add_special_tokens=False)) | set(tokenizer.all_special_ids))


def run_stream(
    tokenizer, prompt: list[int], output: list[int], chunks: list[int], skip: bool
) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = []
    pos = 0
    for size in chunks:
        if pos >= len(output):
            break
        piece = output[pos : pos + size]
        pos += size
        delta = detok.add_tokens(piece)
        deltas.append(delta)
        assert not detok.text.endswith(REPLACEMENT)
        # Stable text is always a prefix of what the tokens so far decode to.
        assert tokenizer.decode(output[:pos], skip_special_tokens=skip).startswith(detok.text)
    if pos < len(output):
        deltas.append(detok.add_tokens(output[pos:]))
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return detok.text, deltas


def test_random_sequences_concatenate_to_decode(tokenizer) -> None:
    rng = random.Random(0)
    special = interesting_ids(tokenizer)
    vocab = len(tokenizer)
    for _ in range(150):
        length = rng.randint(1, 30)
        output = [rng.choice(special) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(length)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        chunks = [rng.randint(1, 4) for _ in range(length)]
        for skip in (True, False):
            text, _ = run_stream(tokenizer, prompt, output, chunks, skip)
            assert text == tokenizer.decode(output, skip_special_tokens=skip)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_sequences_concatenate_to_decode(tokenizer, data) -> None:
    ids = interesting_ids(tokenizer)
    token = st.one_of(st.sampled_from(ids), st.integers(0, len(tokenizer) - 1))
    output = data.draw(st.lists(token, min_size=1, max_size=25))
    prompt = data.draw(st.lists(token, max_size=6))
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=len(output), max_size=len(output)))
    skip = data.draw(st.booleans())
    text, _ = run_stream(tokenizer, prompt, output, chunks, skip)
    assert text == tokenizer.decode(output, skip_special_tokens=skip)


def test_multibyte_characters_are_emitted_once_complete(tokenizer) -> None:
    text = "日本語 🤖 ok ünï"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters really span several tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add_tokens([t]) for t in ids]
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)
    assert "" in deltas  # at least one token only carried part of a character
    assert detok.flush() == ""


def test_trailing_incomplete_character_is_withheld_until_flush(tokenizer) -> None:
    ids = tokenizer.encode("ok 🤖", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    stable = detok.add_tokens(ids[:-1])
    assert REPLACEMENT not in stable
    rest = detok.flush()
    assert stable + rest == tokenizer.decode(ids[:-1])
    assert rest.endswith(REPLACEMENT)


def test_prompt_cut_inside_a_character(tokenizer) -> None:
    ids = tokenizer.encode("Hello 日本", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]).endswith(REPLACEMENT) or tokenizer.decode(ids[:-2]).endswith(
        REPLACEMENT
    )
    cut = len(ids) - 1 if tokenizer.decode(ids[:-1]).endswith(REPLACEMENT) else len(ids) - 2
    prompt, output = ids[:cut], ids[cut:] + tokenizer.encode(" end", add_special_tokens=False)
    text, _ = run_stream(tokenizer, prompt, output, [1] * len(output), True)
    assert text == tokenizer.decode(output)


def test_special_tokens(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("Hi there", add_special_tokens=False), eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        for t in ids:
            detok.add_tokens([t])
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert (tokenizer.eos_token in detok.text) is (not skip)


def test_sentencepiece_leading_space_uses_prompt_context() -> None:
    """Metaspace decoders drop the first token's leading space; prompt context keeps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4, "</s>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    assert sp.decode([2]) == "world"  # the decoder on its own strips the space

    detok = IncrementalDetokenizer(sp, [1])
    assert [detok.add_tokens([t]) for t in (2, 3, 4)] == [" world", "!", " again"]
    # Without a prompt the text matches decode() exactly.
    detok = IncrementalDetokenizer(sp, [])
    assert "".join(detok.add_tokens([t]) for t in (2, 3, 4, 5, 2)) == sp.decode(
        [2, 3, 4, 5, 2], skip_special_tokens=True
    )


# ------------------------------------------------------------------------------ stop strings
def test_stop_string_spanning_two_tokens(tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert " brown" in pieces and " fox" in pieces
    for include, expected in ((False, "The quick br"), (True, "The quick brown fo")):
        detok = IncrementalDetokenizer(tokenizer, [1])
        matcher = StopStringMatcher(["own fo", "zzz"], include)
        found = None
        for i, t in enumerate(ids):
            delta = detok.add_tokens([t])
            stop, cut = matcher.check(detok.text, len(delta))
            if stop is not None:
                found = (i, stop, detok.text[:cut])
                break
        assert found is not None
        step, stop, text = found
        assert pieces[step] == " fox"  # detected on the token that completes it
        assert stop == "own fo" and text == expected


def test_stop_string_rules() -> None:
    m = StopStringMatcher(["abcd", "c", "xy"], include_stop_str_in_output=False)
    assert m.holdback == 3
    # Both "abcd" and "c" complete in the new text; "c" ends first.
    assert m.check("..abcd", 4) == ("c", 4)
    # A match entirely inside old text is not reported again.
    assert m.check("xy....", 2) == (None, None)
    # A match that starts in old text and ends in the new text is found.
    assert m.check("...x" + "y", 1) == ("xy", 3)
    assert m.check("abc", 0) == (None, None)
    inc = StopStringMatcher(["xy"], include_stop_str_in_output=True)
    assert inc.check("12xy34", 3) == ("xy", 4)
    assert StopStringMatcher([], False).holdback == 0
    assert StopStringMatcher([], False).check("abc", 3) == (None, None)


def test_streaming_with_holdback_never_leaks_stop_text(tokenizer) -> None:
    text = "one two three four five six seven"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ("ee fo", "six s", "n"):
        detok = IncrementalDetokenizer(tokenizer, [])
        matcher = StopStringMatcher([stop], False)
        streamed = ""
        final = None
        for t in ids:
            delta = detok.add_tokens([t])
            hit, cut = matcher.check(detok.text, len(delta))
            if hit is not None:
                final = detok.text[:cut]
                break
            safe = detok.text[: max(0, len(detok.text) - matcher.holdback)]
            assert safe.startswith(streamed)
            streamed = safe
        assert final == text[: text.index(stop)]
        assert final.startswith(streamed)


# ------------------------------------------------------------------------------ output layer
def _stream_outputs(tokenizer, output: list[int], **params) -> tuple[str, str]:
    """Feeds ``output`` token by token through the engine's output layer under the engine's update
    rule (a stop token ends the request before any stop-string check); returns the joined stream
    deltas and the final full text."""
    from cbgen.core.update import stop_status
    from cbgen.output_processor import OutputProcessor
    from cbgen.request import RequestGroup
    from cbgen.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=len(output), **params)
    group = RequestGroup.create("r", tokenizer.encode("Hi", add_special_tokens=False), sp, frozenset())
    group.stream = True
    r = group.samples[0]
    proc = OutputProcessor(tokenizer)
    proc.init_request(r, stream=True)
    deltas = []
    for t in output:
        r.append_token(t)
        status = stop_status(r, t, 1 << 20, proc.check_stop_strings)
        if status is not None:
            r.status = status
        deltas.append(proc.make_output(group, delta=True).outputs[0].text)
        if r.is_finished:
            break
    assert r.is_finished
    return "".join(deltas), proc.make_output(group).outputs[0].text


@pytest.mark.parametrize("stop", [None, ["never"]])
@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_text_never_streamed(tokenizer, stop, skip) -> None:
    """A stop token's text is left out of the text (as vLLM does), and no delta ever carried it."""
    words = tokenizer.encode("The capital of France is Paris. Yes.", add_special_tokens=False)
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    eos = tokenizer.eos_token_id
    for output in (words[: words.index(period) + 1], [*words, eos]):
        kwargs = dict(stop_token_ids=[output[-1]], stop=stop, skip_special_tokens=skip)
        joined, final = _stream_outputs(tokenizer, output, **kwargs)
        assert joined == final == tokenizer.decode(output[:-1], skip_special_tokens=skip)
        joined, final = _stream_outputs(tokenizer, output, include_stop_str_in_output=True, **kwargs)
        assert joined == final == tokenizer.decode(output, skip_special_tokens=skip)


def test_min_tokens_holds_back_stop_strings_in_the_output_layer(tokenizer) -> None:
    output = tokenizer.encode(" a, b, c, d, e, f", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in output]
    assert pieces == [" a", ",", " b", ",", " c", ",", " d", ",", " e", ",", " f"]
    # (min_tokens, text): a ", " counts once a token past the first min_tokens completes it, even
    # when its comma came from one of those tokens (min_tokens=2, 4, 10).
    expected = [
        (0, " a"),
        (1, " a"),
        (2, " a"),
        (3, " a, b"),
        (4, " a, b"),
        (5, " a, b, c"),
        (10, " a, b, c, d, e"),
        (11, " a, b, c, d, e, f"),  # no token left after min_tokens: runs to max_tokens
    ]
    for min_tokens, text in expected:
        joined, final = _stream_outputs(tokenizer, output, stop=[", "], min_tokens=min_tokens)
        assert joined == final == text, min_tokens
