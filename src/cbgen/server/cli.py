"""``cbgen serve``: the command line, model loading and a uvicorn server that shuts down gracefully."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from cbgen import envs
from cbgen.async_engine import AsyncEngine
from cbgen.server.routes import build_app
from cbgen.server.state import ServerLimits
from cbgen.utils import get_logger

logger = get_logger("cbgen.server")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbgen serve", description="OpenAI-compatible HTTP server.")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name clients must send as 'model' (default: SmolLM2-135M-Instruct or the folder name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context - 1")
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: what the context allows)",
    )
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-concurrent-requests", type=int, default=1024, help="requests in flight before new ones get 429"
    )
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-prompts-per-request", type=int, default=32)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set CBGEN_API_KEY)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=15.0,
        help="seconds to wait for open connections after SIGTERM",
    )
    return p


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
        **engine_kwargs,
    )
    return llm, AsyncEngine.from_llm(llm, max_concurrent_requests=args.max_concurrent_requests)


def main(argv: list[str] | None = None) -> None:
    """``cbgen serve``: loads the model and serves it until SIGINT/SIGTERM (exit code 0 on SIGTERM)."""
    args = _parser().parse_args(argv)
    for name in ("max_n", "max_body_bytes", "max_concurrent_requests", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    # cbgen's package logger already has a stderr handler; basicConfig would print every record twice.
    get_logger("cbgen").setLevel(args.log_level.upper())
    api_key = args.api_key or envs.get("CBGEN_API_KEY") or None
    llm, async_engine = _load(args)
    limits = ServerLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        max_prompts_per_request=args.max_prompts_per_request,
        api_key=api_key,
    )
    app = build_app(async_engine, llm.tokenizer, _served_name(args.model, args.served_model_name), limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )
    server = _GracefulServer(config, async_engine.start_shutdown)
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
    a final chunk and ``[DONE]``.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
