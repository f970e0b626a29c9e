"""What one app knows about the engine it serves, and the limits it enforces on requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cbgen.async_engine import AsyncEngine, EngineShutdownError, QueueFullError, RequestStream
from cbgen.sampling_params import SamplingParams
from cbgen.server.errors import APIError, bad_request, sampling_param_of
from cbgen.server.metrics import ServerMetrics


@dataclass
class ServerLimits:
    """Per-request limits the server enforces before anything reaches the engine (400 past them).

    ``None`` for ``max_prompt_tokens`` / ``max_tokens_limit`` means "whatever the model's context
    allows".  ``api_key`` set: every ``/v1`` path needs ``Authorization: Bearer <key>``.
    """

    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_body_bytes: int = 1 << 20
    max_logprobs: int = 20
    max_prompts_per_request: int = 32
    max_stop_sequences: int = 16
    max_stop_length: int = 512
    max_logit_bias: int = 300
    api_key: str | None = field(default=None, repr=False)


class ServerState:
    """Request handling state shared by the routes of one app (``app.state.cbgen``)."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        served_model_name: str,
        limits: ServerLimits,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.limits = limits
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())
        core = engine.engine
        self.max_model_len = int(core.max_model_len)
        self.vocab_size = int(core.vocab_size)
        self.block_size = int(core.block_manager.block_size)
        self.num_blocks = int(core.block_manager.num_blocks)
        self.max_logprobs = min(limits.max_logprobs, int(core.config.max_logprobs))
        self._token_text: dict[int, str] = {}

    def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], base_id: str
    ) -> list[RequestStream]:
        """Queues every prompt of one HTTP request, or none of them."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(self.engine.add_request(ids, p, request_id=f"{base_id}-{i}"))
        except BaseException as exc:
            for s in streams:
                s.cancel()
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, EngineShutdownError):
                raise APIError(503, str(exc), "server_error", code="service_unavailable") from None
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param=sampling_param_of(str(exc))) from None
            raise
        return streams

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs show it (``<id>`` without a tokenizer), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"<{token_id}>"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
