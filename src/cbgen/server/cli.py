"""``cbgen serve``: the command line, model loading and a uvicorn server that shuts down gracefully."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from cbgen import envs
from cbgen.async_engine import AsyncEngine
from cbgen.cli import (
    SETUP_ERRORS,
    ArgumentParser,
    dtype_name,
    fail,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from cbgen.core.fairness import Fairness
from cbgen.server.connections import (
    ConnectionGuard,
    ConnectionLimits,
    guarded_protocol,
    quiet_accept_errors,
    raise_fd_limit,
)
from cbgen.server.routes import build_app
from cbgen.server.state import ServerLimits
from cbgen.utils import get_logger

logger = get_logger("cbgen.server")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
PROG = "cbgen serve"


def _share(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 and <= 1, or 'none', got {text!r}")
    return value


def _old_share(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else positive_float(text)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="OpenAI-compatible HTTP server. Limits and their defaults: docs/server.md.",
        epilog="The API key is best given as the CBGEN_API_KEY environment variable: --api-key is "
        "visible to every user of the machine in the process list.",
    )
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name clients must send as 'model' (default: SmolLM2-135M-Instruct or the folder name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="shard the model over N ranks with transformers' tensor parallelism; start with "
        "`torchrun --nproc-per-node N -m cbgen.cli serve --tensor-parallel-size N ...` (rank 0 serves "
        "HTTP, the others follow its steps)",
    )
    p.add_argument("--dtype", type=dtype_name, default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument(
        "--num-blocks", type=positive_int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument(
        "--max-prompt-tokens", type=positive_int, default=None, help="default: the model's context - 1"
    )
    p.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=None,
        help="largest max_tokens a request may ask for (default: what the context allows)",
    )
    p.add_argument("--max-n", type=positive_int, default=16)
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20)
    p.add_argument(
        "--max-concurrent-requests",
        type=positive_int,
        default=1024,
        help="requests in flight before new ones get 429",
    )
    p.add_argument("--max-logprobs", type=non_negative_int, default=20)
    p.add_argument("--max-prompts-per-request", type=positive_int, default=32)
    _admission_flags(p)
    _connection_flags(p)
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special-token text in chat messages as control tokens (default: kept literal)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1; prefer CBGEN_API_KEY=KEY in the environment, "
        "which keeps the key out of the process list",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=non_negative_float,
        default=15.0,
        help="seconds to wait for open connections after SIGTERM",
    )
    return p


def _admission_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-request-work",
        type=positive_int,
        default=None,
        help="token slots one request may need: n x (prompt + max_tokens), summed over its prompts "
        "(default: --max-n x the context)",
    )
    p.add_argument(
        "--max-inflight-work",
        type=positive_int,
        default=None,
        help="token slots of all requests in flight before new ones get 429 (default: 32 x --max-request-work)",
    )
    p.add_argument(
        "--client-share",
        type=_share,
        default=0.5,
        help="fraction of the in-flight requests and token slots one client address may hold ('none': no cap)",
    )
    p.add_argument(
        "--max-response-bytes",
        type=positive_int,
        default=64 << 20,
        help="largest estimated non-streamed response; larger requests must stream",
    )
    p.add_argument(
        "--stream-buffer",
        type=positive_int,
        default=64,
        help="outputs a stream holds for a client that does not read before its request is paused",
    )
    p.add_argument("--scheduling", choices=["fair", "fcfs"], default="fair", help="policy between requests")
    p.add_argument(
        "--fair-quantum",
        type=non_negative_int,
        default=512,
        help="tokens a request computes before it counts as old work",
    )
    p.add_argument(
        "--fair-old-share",
        type=_old_share,
        default=0.25,
        help="old work per token of young work in a step ('none': no cap; raise it on GPUs)",
    )


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=4096,
        help="open connections (idle ones are evicted first)",
    )
    p.add_argument(
        "--header-timeout", type=positive_float, default=10.0, help="seconds to complete a request head"
    )
    p.add_argument(
        "--body-timeout", type=positive_float, default=30.0, help="seconds to receive a request body"
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=non_negative_int,
        default=5,
        help="seconds an idle keep-alive connection stays",
    )
    p.add_argument(
        "--write-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a response may wait for a client that does not read before it is aborted",
    )
    p.add_argument(
        "--write-buffer-bytes",
        type=positive_int,
        default=256 * 1024,
        help="kernel send buffer per connection (a client that stops reading is noticed after this much)",
    )


def _served_name(model: str | None, explicit: str | None) -> str:
    if explicit:
        return explicit
    if model is None:
        return DEFAULT_SERVED_NAME
    path = Path(model.rstrip("/\\"))
    return path.stem if path.suffix == ".gguf" else path.name or str(model)


def _load(args: argparse.Namespace) -> tuple[Any, AsyncEngine]:
    """The model as an ``LLM`` (for its tokenizer) and the async engine running it."""
    from cbgen.llm import LLM

    engine_kwargs: dict[str, Any] = {"max_logprobs": args.max_logprobs}
    if args.max_model_len is not None:
        engine_kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        **engine_kwargs,
    )
    control = llm.engine.control
    if control.is_follower:
        # The other ranks of a tensor-parallel group serve nothing: they run the root's steps.
        llm.engine.follow()
        raise SystemExit(0)
    request_work = args.max_request_work or llm.engine.request_limits.max_work(args.max_n)
    args.max_request_work = request_work
    fairness = None
    # Under tensor parallelism every rank must schedule alike, and fair scheduling and stream pauses
    # are decisions only the root's front end sees: first come, first served there.
    lockstep = control.lockstep
    if args.scheduling == "fair" and not lockstep:
        fairness = Fairness(quantum=args.fair_quantum, old_share=args.fair_old_share)
    engine = AsyncEngine.from_llm(
        llm,
        max_concurrent_requests=args.max_concurrent_requests,
        max_inflight_work=args.max_inflight_work or 32 * request_work,
        client_share=args.client_share,
        stream_buffer=None if lockstep else args.stream_buffer,
        fairness=fairness,
    )
    return llm, engine


def main(argv: list[str] | None = None) -> None:
    """``cbgen serve``: loads the model and serves it until SIGINT/SIGTERM (exit code 0 on SIGTERM)."""
    args = _parser().parse_args(argv)  # every number checked as it is parsed
    connections = ConnectionLimits(
        max_connections=raise_fd_limit(args.max_connections),
        header_timeout=args.header_timeout,
        write_timeout=args.write_timeout,
        write_buffer=args.write_buffer_bytes,
    )
    # cbgen's package logger already has a stderr handler; basicConfig would print every record twice.
    get_logger("cbgen").setLevel(args.log_level.upper())
    api_key = args.api_key or envs.get("CBGEN_API_KEY") or None
    try:
        llm, async_engine = _load(args)
    except SETUP_ERRORS as exc:  # a missing model, settings the model or the machine cannot take
        fail(PROG, str(exc))
    limits = ServerLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        max_prompts_per_request=args.max_prompts_per_request,
        max_request_work=args.max_request_work,
        max_response_bytes=args.max_response_bytes,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
        allow_special_tokens=args.allow_special_tokens_in_content,
        api_key=api_key,
    )
    app = build_app(async_engine, llm.tokenizer, _served_name(args.model, args.served_model_name), limits)
    guard = ConnectionGuard(connections)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
        http=guarded_protocol(guard),
        timeout_keep_alive=args.keep_alive_timeout,
        backlog=4096,  # a burst of connections waits in the kernel instead of being dropped (SYN retry: 1 s)
    )
    app.state.cbgen.metrics.watch_connections(guard)
    server = _GracefulServer(config, async_engine.start_shutdown, guard)
    # uvicorn re-raises the signal it shut down for once it restored the previous handler; a no-op
    # previous handler turns a SIGTERM-initiated graceful shutdown into a normal exit with code 0.
    previous = signal.signal(signal.SIGTERM, _note_sigterm)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info("server stopped")


def _note_sigterm(signum: int, frame: Any) -> None:
    logger.info("SIGTERM handled: graceful shutdown complete")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, ending in-flight generations as soon as shutdown starts.

    uvicorn waits for open connections before it runs the lifespan shutdown, and a stream keeps its
    connection open until its generation ends; aborting first lets every stream finish promptly with
    a final chunk and ``[DONE]``.  The listener stays open until the requests in flight have ended
    (at most the graceful timeout), so meanwhile ``/health`` answers 503 instead of refusing.
    """

    def __init__(
        self, config: uvicorn.Config, on_shutdown: Callable[[], None], guard: ConnectionGuard
    ) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._guard = guard

    async def startup(self, sockets: Any = None) -> None:
        """uvicorn's startup, with the accept loop's resource errors counted instead of logged."""
        quiet_accept_errors(asyncio.get_running_loop(), self._guard)
        await super().startup(sockets)

    async def shutdown(self, sockets: Any = None) -> None:
        """Aborts generations, waits (listening) for the requests in flight, then shuts uvicorn down."""
        self._on_shutdown()
        in_flight = set(self.server_state.tasks)
        if in_flight:
            await asyncio.wait(in_flight, timeout=self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
