"""OpenAI request → engine input: body reading and its limits, SamplingParams, ``max_tokens``.

Everything here runs before a request reaches the engine, so every rejection is a 4xx and the engine
never sees a request the server would have refused.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from cbgen.limits import request_work
from cbgen.sampling_params import SamplingParams
from cbgen.server.errors import APIError, bad_request, quote, sampling_param_of, validation_error
from cbgen.server.json_child import loads_here
from cbgen.server.prompts import chat_prompt, check_prompt, completion_prompts
from cbgen.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from cbgen.server.state import LARGE_BYTES, OFFLOAD_BYTES, ServerLimits, ServerState
from cbgen.server.structured import structured_kwargs
from cbgen.server.template_child import Templated
from cbgen.server.tools import ToolPlan, tool_plan


@dataclass
class GenerationPlan:
    """What one HTTP request asks the engine for, and how its answer is to be shaped."""

    chat: bool
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    logprobs: bool
    include_usage: bool
    stream: bool
    tools: ToolPlan | None = None  # chat with tools (cbgen.server.tools)


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The raw request body, enforcing the size limit before reading and ``timeout`` seconds for all of
    it to arrive (a client that trickles a body would otherwise hold its connection indefinitely)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if declared > max_bytes:
            raise APIError(
                413,
                f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                code="request_too_large",
            )
    chunks: list[bytes] = []

    async def receive() -> None:
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            # Checked while streaming: a chunked body has no Content-Length to check up front.
            if total > max_bytes:
                raise APIError(
                    413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large"
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"request body not received within {timeout:g} s", code="request_timeout"
        ) from None
    return b"".join(chunks)


_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(raw: bytes, loads: Callable[[bytes], Any] = loads_here) -> dict[str, Any]:
    """A request body as a JSON object; invalid UTF-8, JSON or Unicode is a 400.  ``loads`` parses
    (:class:`cbgen.server.json_child.JsonChild` for large bodies)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    # UTF-8 cannot carry a surrogate, but a JSON escape can: "\ud800" alone decodes to a string no
    # tokenizer or encoder accepts.  Only bodies with such an escape need the walk (JSON's "u" is
    # lower case; searching the bytes skips a lower-cased copy of a megabyte body).
    if b"\\ud" in raw or b"\\uD" in raw:
        _reject_lone_surrogates(obj)
    return obj


def _reject_lone_surrogates(obj: Any) -> None:
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_surrogates(path or "body", value, path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                # A key is checked before it joins a path: the path goes into the error message.
                _check_surrogates(f"{path or 'body'}: key {quote(key, 32)}", key, path or None)
                part = key if len(key) <= 64 else f"{key[:64]}..."
                stack.append((f"{path}.{part}" if path else part, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))


def _check_surrogates(what: str, text: str, param: str | None) -> None:
    m = _SURROGATE.search(text)
    if m is not None:
        raise bad_request(
            f"{what}: string contains a lone UTF-16 surrogate (U+{ord(m.group()):04X}), which is not "
            "valid Unicode",
            param=param,
        )


def parse_body(model: type[SamplingFields], obj: dict[str, Any]) -> Any:
    """``obj`` validated as ``model``; a schema violation is a 400."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_model(state: ServerState, name: str) -> None:
    """404 unless ``name`` is the model this server serves."""
    if name != state.model_name:
        raise APIError(
            404,
            f"the model {quote(name)} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_stream_options(req: SamplingFields) -> bool:
    """Whether a final usage chunk was asked for; ``stream_options`` without streaming is a 400."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed together with stream=true", param="stream_options")
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def resolve_max_tokens(
    state: ServerState, requested: int | None, default: int | None, prompt_len: int, param: str
) -> int:
    """The ``max_tokens`` to run with (:meth:`RequestLimits.default_max_tokens` when the request
    names none, within ``default`` and the server's cap); a requested value that cannot fit is a
    400, never clamped."""
    lim = state.request_limits
    cap = state.limits.max_tokens_limit
    if requested is None:
        value = lim.default_max_tokens(prompt_len, default, cap)
    else:
        if requested < 1:
            raise bad_request(f"{param} must be at least 1, got {requested}", param=param)
        if cap is not None and requested > cap:
            raise bad_request(f"{param}={requested} exceeds the server limit of {cap}", param=param)
        if requested > lim.context_room(prompt_len):
            raise bad_request(
                f"this model's context is {state.max_model_len} tokens; the prompt has {prompt_len} and "
                f"{param}={requested} would exceed it",
                param=param,
            )
        value = requested
    if not lim.fits_kv(prompt_len + value):
        raise bad_request(
            f"prompt + {param} need {lim.blocks_for(prompt_len + value)} KV-cache blocks but the server "
            f"has {lim.num_blocks}; "
            f"lower {param} or shorten the prompt",
            param=param,
        )
    return value


def _check_request_limits(req: SamplingFields, lim: ServerLimits) -> list[str]:
    """Checks ``n``, ``stop`` and ``seed`` against the limits; returns the stop strings as a list."""
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", param="n")
    if req.n > lim.max_n:
        raise bad_request(f"n={req.n} exceeds the server limit of {lim.max_n}", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > lim.max_stop_sequences:
        raise bad_request(f"at most {lim.max_stop_sequences} stop sequences are allowed", param="stop")
    if any(len(s) > lim.max_stop_length for s in stop):
        raise bad_request(f"stop sequences are limited to {lim.max_stop_length} characters", param="stop")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
    return stop


def _logit_bias(req: SamplingFields, lim: ServerLimits) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (string token ids) as the engine's ``{token_id: bias}``."""
    if not req.logit_bias:
        return None
    if len(req.logit_bias) > lim.max_logit_bias:
        raise bad_request(f"logit_bias may name at most {lim.max_logit_bias} tokens", param="logit_bias")
    logit_bias = {}
    for key, value in req.logit_bias.items():
        if not re.fullmatch(r"[0-9]{1,9}", key):
            raise bad_request(f"logit_bias key {quote(key)} is not a token id", param="logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias value for token {key} must be in [-100, 100]", param="logit_bias")
        logit_bias[int(key)] = float(value)
    return logit_bias


def sampling_params(
    state: ServerState, req: SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The request's sampling fields as :class:`SamplingParams`, with OpenAI's defaults filled in."""
    stop = _check_request_limits(req, state.limits)
    logit_bias = _logit_bias(req, state.limits)
    top_k = -1 if req.top_k is None else req.top_k
    if top_k >= state.vocab_size:
        top_k = -1  # keeping the whole vocabulary is the same as no top-k
    kwargs: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=logit_bias,
        stop=stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        seed=req.seed,
        logprobs=logprobs,
    )
    kwargs.update(structured_kwargs(state, req))  # response_format, guided_*, forced tool calls
    if kwargs["min_tokens"] > max_tokens:
        raise bad_request(
            f"min_tokens={kwargs['min_tokens']} exceeds max_tokens={max_tokens}", param="min_tokens"
        )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), param=sampling_param_of(str(exc))) from None


def plan_completion(state: ServerState, req: CompletionRequest) -> GenerationPlan:
    """``POST /v1/completions``: every prompt of the request with its own ``SamplingParams``."""
    check_model(state, req.model)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= state.max_logprobs:
        raise bad_request(f"logprobs must be between 0 and {state.max_logprobs}", param="logprobs")
    include_usage = check_stream_options(req)
    _check_request_limits(req, state.limits)
    prompt = req.prompt
    items = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else prompt
    # Before tokenising anything: a text prompt has at least one token.
    lengths = [len(p) if isinstance(p, list) else 1 for p in items]
    exact = req.max_tokens is not None and all(isinstance(p, list) for p in items)
    least = max(1, req.max_tokens or 1)
    check_work(state, sum(request_work(req.n, n, least) for n in lengths), req.n * len(items), exact)
    prompts = completion_prompts(state, req)
    params = [
        sampling_params(
            state, req, resolve_max_tokens(state, req.max_tokens, 16, len(ids), "max_tokens"), req.logprobs
        )
        for ids in prompts
    ]
    plan = GenerationPlan(
        False, prompts, params, req.n, req.logprobs is not None, include_usage, bool(req.stream)
    )
    check_size(state, plan)
    return plan


def plan_chat(
    state: ServerState, req: ChatCompletionRequest, templated: Templated | None = None
) -> GenerationPlan:
    """``POST /v1/chat/completions``: the templated conversation as one prompt (``templated``: the
    template child's answer for a large body, whose prompt or error stands in for templating here)."""
    check_model(state, req.model)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= state.max_logprobs:
            raise bad_request(
                f"top_logprobs must be between 0 and {state.max_logprobs}", param="top_logprobs"
            )
    include_usage = check_stream_options(req)
    ids = templated.prompt() if templated is not None else None
    if ids is None:
        ids = chat_prompt(state, req)
    check_prompt(state, ids)
    requested, name = (req.max_completion_tokens, "max_completion_tokens")
    if requested is None:
        requested, name = req.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(state, requested, None, len(ids), name)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, max_tokens, logprobs)
    plan = GenerationPlan(True, [ids], [params], req.n, bool(req.logprobs), include_usage, bool(req.stream))
    plan.tools = tool_plan(req)
    check_size(state, plan)
    return plan


# Rough sizes of a non-streamed response, per generated token: its text in JSON, and one logprob
# entry (token text, value, and for chat its bytes) for the token and each top candidate.
_TEXT_BYTES_PER_TOKEN = 16
_LOGPROB_ENTRY_BYTES = 64
_CHOICE_BYTES = 256


def check_work(state: ServerState, work: int, sequences: int, exact: bool = True) -> None:
    """400 if a request's token slots (n x (prompt + max_tokens), summed over prompts; a lower bound
    unless ``exact``) exceed the per-request limit."""
    limit = state.max_request_work
    if work > limit:
        raise APIError(
            400,
            f"request needs {'' if exact else 'at least '}{work:,} token slots ({sequences:,} sequences x "
            "(prompt + max_tokens)), over "
            f"the limit of {limit:,} per request; lower n, max_tokens, the prompts or their number",
            code="request_too_large",
        )


def check_size(state: ServerState, plan: GenerationPlan) -> None:
    """400 if the plan's work exceeds the per-request limit, or its non-streamed response could
    exceed ``max_response_bytes`` (refused before anything is generated)."""
    pairs = list(zip(plan.prompts, plan.params))
    check_work(state, sum(request_work(p.n, len(ids), p.max_tokens) for ids, p in pairs), plan.n * len(pairs))
    if plan.stream:
        return
    size = 0
    for p in plan.params:
        per_token = _TEXT_BYTES_PER_TOKEN
        if plan.logprobs:
            per_token += _LOGPROB_ENTRY_BYTES * (1 + (p.logprobs or 0))
        size += p.n * (_CHOICE_BYTES + p.max_tokens * per_token)
    limit = state.limits.max_response_bytes
    if size > limit:
        raise APIError(
            400,
            f"the response could reach about {size:,} bytes, over the limit of {limit:,} bytes for a "
            "non-streamed response; stream it (stream=true) or lower n, max_tokens or logprobs",
            param="stream",
            code="response_too_large",
        )


def plan_request(state: ServerState, chat: bool, raw: bytes) -> GenerationPlan:
    """The plan of a raw request body: JSON, schema, tokenisation, chat template and limits (CPU work
    that runs on a worker thread when the body is large)."""
    templated = state.template_child.template(raw) if chat and len(raw) >= LARGE_BYTES else None
    if templated is not None:
        loads = templated.loads
    else:
        loads = state.json_child.loads if len(raw) >= OFFLOAD_BYTES else loads_here
    obj = parse_json(raw, loads)
    if chat:
        return plan_chat(state, parse_body(ChatCompletionRequest, obj), templated)
    return plan_completion(state, parse_body(CompletionRequest, obj))
