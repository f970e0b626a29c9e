"""Turns sequence state into user-facing outputs: detokenisation, stop strings, stream deltas.

Text is only built incrementally when something needs it during generation (stop strings or
streaming); otherwise each sample is decoded once when it finishes, which keeps per-step CPU work
off the hot path.

Stop semantics follow vLLM: a stop token (EOS or one of ``stop_token_ids``) stays in
``token_ids`` but its text is left out of ``text`` unless ``include_stop_str_in_output``, and
``min_tokens`` holds back stop strings as it holds back stop tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbgen.detokenizer import IncrementalDetokenizer, StopStringMatcher
from cbgen.outputs import CompletionOutput, RequestOutput
from cbgen.request import Request, RequestGroup, RequestStatus


@dataclass
class SampleState:
    """Per-sample text state."""

    detok: IncrementalDetokenizer | None = None
    matcher: StopStringMatcher | None = None
    fed_tokens: int = 0  # output tokens given to the detokeniser
    final_text: str | None = None  # text cut at a stop string
    sent_tokens: int = 0  # stream cursor, in tokens
    sent_chars: int = 0  # stream cursor, in characters
    sent_prompt_logprobs: bool = False
    flushed: bool = False
    extra: dict = field(default_factory=dict)


class OutputProcessor:
    """Owns the tokenizer-side work of the engine."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def init_request(self, r: Request, stream: bool = False) -> None:
        """(Re)creates a sample's text state."""
        state = SampleState()
        if self.tokenizer is not None and (r.params.stop or stream):
            state.detok = IncrementalDetokenizer(
                self.tokenizer, r.prompt_token_ids, skip_special_tokens=r.params.skip_special_tokens
            )
            if r.params.stop:
                state.matcher = StopStringMatcher(r.params.stop, r.params.include_stop_str_in_output)
        r.output_state = state

    def _feed(self, r: Request) -> None:
        state: SampleState = r.output_state
        if state.detok is None:
            return
        start, end = r.num_prompt_tokens, _text_end(r)
        if state.fed_tokens < end:
            state.detok.add_tokens(r.token_ids[start + state.fed_tokens : start + end])
            state.fed_tokens = end

    def check_stop_strings(self, r: Request, token: int) -> str | None:
        """Feeds the new token to the detokeniser; returns the matched stop string, if any.

        ``min_tokens``: text produced by the first ``min_tokens`` output tokens cannot complete a
        stop string, so nothing stops the request before token ``min_tokens + 1``, as for stop
        tokens.  Decision for a match that begins in that text and is completed by a later token:
        it counts and ends the request (vLLM does the same), even though the text cut before it
        is then shorter than what the first ``min_tokens`` tokens spelled.  ``min_tokens`` counts
        generated tokens, not characters of the returned text, just as the text of a stop token
        is dropped.  Requiring the whole match to lie after those tokens instead would run on past
        a stop string completed after ``min_tokens``, and differ from vLLM.
        """
        state: SampleState = r.output_state
        if state.matcher is None:
            return None
        before = len(state.detok.text)
        self._feed(r)
        if r.num_output_tokens <= r.params.min_tokens:
            return None
        text = state.detok.text
        matched, cut = state.matcher.check(text, len(text) - before)
        if matched is not None:
            state.final_text = text[:cut]
        return matched

    def text(self, r: Request) -> str:
        """The sample's full output text (cut at a stop string if one matched)."""
        state: SampleState = r.output_state
        if state.final_text is not None:
            return state.final_text
        if self.tokenizer is None:
            return ""
        if state.detok is not None:
            self._feed(r)
            if r.is_finished:
                if not state.flushed:
                    state.detok.flush()  # a trailing incomplete character, if any
                    state.flushed = True
                return state.detok.text
            # Hold back what could still become a stop string.
            hold = state.matcher.holdback if state.matcher is not None else 0
            return state.detok.text[: max(0, len(state.detok.text) - hold)] if hold else state.detok.text
        outputs = r.token_ids[r.num_prompt_tokens : r.num_prompt_tokens + _text_end(r)]
        return self.tokenizer.decode(outputs, skip_special_tokens=r.params.skip_special_tokens)

    def make_output(self, group: RequestGroup, delta: bool = False) -> RequestOutput:
        """Full (or, for streams, incremental) output of a group."""
        outs = []
        for r in group.samples:
            state: SampleState = r.output_state
            text = self.text(r)
            start_tok = state.sent_tokens if delta else 0
            start_chr = state.sent_chars if delta else 0
            outs.append(
                CompletionOutput(
                    index=r.sample_index,
                    text=text[start_chr:],
                    token_ids=r.token_ids[r.num_prompt_tokens + start_tok :],
                    token_logprobs=r.token_logprobs[start_tok:],
                    raw_logprobs=r.raw_logprobs[start_tok:],
                    log_kept_mass=r.log_kept_mass[start_tok:],
                    kept_counts=r.kept_counts[start_tok:],
                    kept_thresholds=r.kept_thresholds[start_tok:],
                    top_logprobs=r.top_logprobs[start_tok:] if r.top_logprobs is not None else None,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
            if delta or group.stream:
                state.sent_tokens = r.num_output_tokens
                state.sent_chars = len(text)
        leader = group.samples[0]
        prompt_lp = leader.prompt_logprobs
        if delta and leader.output_state.sent_prompt_logprobs:
            prompt_lp = None
        elif prompt_lp is not None and leader.num_output_tokens > 0:
            leader.output_state.sent_prompt_logprobs = True
        errors = [r.error for r in group.samples if r.error]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.all_finished(),
            prompt_logprobs=prompt_lp,
            weight_version=max(r.weight_version for r in group.samples),
            error="; ".join(errors) if errors else None,
            num_cached_tokens=leader.num_cached_tokens,
        )


def _text_end(r: Request) -> int:
    """How many output tokens the text covers: all of them, except a stop token that ended the
    request (its id stays in ``token_ids``) unless ``include_stop_str_in_output``.

    A stop token is only known to be one once the request has finished on it, and it is the last
    token then; it was never given to the detokeniser before, so no streamed delta holds its text.
    """
    num_output = len(r.token_ids) - r.num_prompt_tokens
    if (
        r.status is RequestStatus.FINISHED_STOPPED
        and not isinstance(r.stop_reason, str)  # a string is a stop string: cut by the matcher
        and not r.params.include_stop_str_in_output
        and num_output > 0
    ):
        return num_output - 1
    return num_output
