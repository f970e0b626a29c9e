"""``cbgen generate | serve | info | bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cbgen generate", description="Generate text for prompts.")
    parser.add_argument("prompts", nargs="*", help="prompts (default: read --file)")
    parser.add_argument(
        "--file", help="a text file with one prompt per line, or .jsonl with a 'prompt' field"
    )
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = parser.parse_args(argv)

    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                prompts.append(json.loads(line)["prompt"] if args.file.endswith(".jsonl") else line)
    if not prompts:
        parser.error("give prompts as arguments or with --file")

    from cbgen import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
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


def _info(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="cbgen info",
        description="Print the execution plan cbgen resolves for a model on this machine (generates nothing).",
    )
    parser.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="the parity plan (LLM(..., batch_invariant=True))"
    )
    args = parser.parse_args(argv)

    from cbgen.config import EngineConfig
    from cbgen.model.loading.loader import load_model
    from cbgen.model.plan import plan_for_model

    model, _ = load_model(args.model, dtype=args.dtype, device=args.device, tokenizer=False)
    try:
        config = EngineConfig(attention_backend=args.attention_backend, batch_invariant=args.batch_invariant)
        plan = plan_for_model(model, config)
    except ValueError as exc:
        sys.exit(f"cbgen info: {exc}")
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
