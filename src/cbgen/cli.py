"""``cbgen generate | serve | info | bench``.

A bad argument or a model that cannot be loaded is one line, ``cbgen COMMAND: error: ...`` on stderr
(argparse's form, without its usage) and exit status 2, never a traceback: numbers are checked as the
arguments are parsed (the parser and argument types below, shared by ``cbgen serve`` and ``cbgen
bench``), and the errors a
model or its settings can raise while loading (``OSError``, ``ValueError``) are caught around the
loading only, so a bug elsewhere still shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import NoReturn

# What loading a model raises for a bad path, model or setting (missing files, unknown dtype or
# device, a context the cache cannot hold); anything else keeps its traceback.
SETUP_ERRORS = (OSError, ValueError)


def fail(prog: str, message: str) -> NoReturn:
    """Exits the way argparse does on a bad argument, without the usage: one line on stderr,
    ``prog: error: message``, and status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line, ``prog: error: message``, without the
    usage (which ``--help`` prints; ``cbgen serve``'s alone is 30 lines)."""

    def error(self, message: str) -> NoReturn:
        """Exits with ``message`` as :func:`fail` does."""
        fail(self.prog, message)


def _bounded(kind: type, low: float, above: bool, high: float | None = None) -> Callable[[str], float]:
    name = "an integer" if kind is int else "a number"
    rule = f"> {low}" if above else f">= {low}"
    if high is not None:
        rule += f" and <= {high}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {name} {rule}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if above else value >= low)
        if not ok or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {name} {rule}, got {text!r}")
        return value

    return parse


positive_int = _bounded(int, 1, above=False)
non_negative_int = _bounded(int, 0, above=False)
positive_float = _bounded(float, 0, above=True)
non_negative_float = _bounded(float, 0, above=False)
port = _bounded(int, 0, above=False, high=65535)


def dtype_name(text: str) -> str:
    """A ``--dtype`` value the loader accepts (``auto``, ``float32``, ``bf16``...), as given."""
    from cbgen.utils import resolve_dtype

    try:
        resolve_dtype(text, None, "cpu")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _generate(argv: list[str]) -> None:
    prog = "cbgen generate"
    parser = ArgumentParser(prog=prog, description="Generate text for prompts.")
    parser.add_argument("prompts", nargs="*", help="prompts (default: read --file)")
    parser.add_argument(
        "--file", help="a text file with one prompt per line, or .jsonl with a 'prompt' field"
    )
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", type=dtype_name, default="auto")
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--top-p", type=_bounded(float, 0, above=True, high=1), default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = parser.parse_args(argv)

    prompts = list(args.prompts)
    if args.file:
        prompts += _read_prompts(prog, args.file)
    if not prompts:
        parser.error("give prompts as arguments or with --file")

    from cbgen import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        llm = LLM(args.model, dtype=args.dtype)
    except SETUP_ERRORS as exc:
        fail(prog, str(exc))
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "finish_reason": completion.finish_reason,
                        "num_tokens": len(completion.token_ids),
                    }
                )
            )
        else:
            print(f">>> {prompt}\n{completion.text.strip()}\n")


def _read_prompts(prog: str, path: str) -> list[str]:
    """The prompts of ``--file``: one per line, or the ``prompt`` field of each line of a .jsonl."""
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if not path.endswith(".jsonl"):
                    prompts.append(line)
                    continue
                try:
                    prompts.append(str(json.loads(line)["prompt"]))
                except (ValueError, KeyError, TypeError):
                    fail(prog, f"{path}:{number}: expected a JSON object with a 'prompt' field")
    except (OSError, UnicodeDecodeError) as exc:
        fail(prog, f"cannot read --file {path}: {exc}")
    return prompts


def _info(argv: list[str]) -> None:
    prog = "cbgen info"
    parser = ArgumentParser(
        prog=prog,
        description="Print the execution plan cbgen resolves for a model on this machine (generates nothing).",
    )
    parser.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    parser.add_argument("--dtype", type=dtype_name, default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="the parity plan (LLM(..., batch_invariant=True))"
    )
    args = parser.parse_args(argv)

    from cbgen.config import EngineConfig
    from cbgen.model.loading.loader import load_model
    from cbgen.model.plan import plan_for_model

    try:
        config = EngineConfig(attention_backend=args.attention_backend, batch_invariant=args.batch_invariant)
        model, _ = load_model(args.model, dtype=args.dtype, device=args.device, tokenizer=False)
        plan = plan_for_model(model, config)
    except SETUP_ERRORS as exc:
        fail(prog, str(exc))
    print(plan.report())


def _bench(argv: list[str]) -> None:
    # The harness is its own package (benchmarks/cbgen_bench), so the runtime wheel stays free of it.
    try:
        from cbgen_bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "cbgen_bench":
            raise
        sys.exit(
            "cbgen bench needs the benchmark harness, which is not installed: run `make bench`, or "
            "`pip install -e benchmarks` from a cbgen checkout"
        )
    bench_main(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``cbgen`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate", "serve", "info", "bench"}
    if not argv or argv[0] not in commands:
        print("usage: cbgen {generate,serve,info,bench} [options]   (cbgen COMMAND --help for details)")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    if command == "generate":
        _generate(rest)
    elif command == "serve":
        from cbgen.server.app import main as serve_main

        serve_main(rest)
    elif command == "info":
        _info(rest)
    else:
        _bench(rest)


if __name__ == "__main__":
    main()
