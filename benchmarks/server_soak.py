"""Server soak: many requests through a real `cbgen serve` with the official `openai` client.

A mix of streamed and non-streamed completions and chats, n>1, stop strings and clients that
disconnect mid-stream at random.  Checks that nothing is lost (every request that was not
abandoned on purpose gets a complete, well-formed answer), that every KV block is free and nothing
is in flight at the end, and reports the server's RSS over the run (after warm-up it should stay
flat).  Not a CI test (it takes minutes); its numbers go in the closing notes and docs/server.md.

    python benchmarks/server_soak.py --requests 10000 --concurrency 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def start_server(model: str | None, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cbgen.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


PROMPTS = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "Say hello in French.",
    "Give me a word that rhymes with cat.",
]


async def one_request(client: openai.AsyncOpenAI, model: str, rng: random.Random, stats: Counter) -> None:
    kind = rng.choice(["stream", "stream", "chat", "chat_n", "stop", "disconnect", "disconnect"])
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(4, 24)
    try:
        if kind == "chat":
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
            )
            assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        elif kind == "chat_n":
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                n=2,
                temperature=1.0,
            )
            assert len(r.choices) == 2 and all(c.finish_reason in ("stop", "length") for c in r.choices)
        elif kind == "stop":
            r = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, stop=[".", "\n"], temperature=0.7
            )
            assert r.choices[0].finish_reason in ("stop", "length")
            assert "." not in r.choices[0].text and "\n" not in r.choices[0].text
        else:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0.8
            )
            chunks, finish = 0, None
            quit_after = rng.randint(1, 3) if kind == "disconnect" else None
            async for chunk in stream:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
                if quit_after is not None and chunks >= quit_after:
                    await stream.close()  # the client goes away mid-stream
                    break
            if quit_after is None:
                assert finish in ("stop", "length"), finish
        stats[kind] += 1
    except Exception as exc:  # counted and reported: the soak goes on
        stats[f"error:{kind}:{type(exc).__name__}"] += 1
        if stats["errors_printed"] < 5:
            stats["errors_printed"] += 1
            print(f"error in {kind}: {exc!r}", file=sys.stderr)


async def soak(url: str, pid: int, total: int, concurrency: int, seed: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    rng = random.Random(seed)
    model = (await client.models.list()).data[0].id
    stats: Counter = Counter()
    rss: list[tuple[int, float]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    done = 0

    async def worker() -> None:
        nonlocal done
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await one_request(client, model, rng, stats)
            done += 1
            if done % max(1, total // 40) == 0:
                rss.append((done, _rss_mib(pid)))
                print(f"{done}/{total} requests, server RSS {rss[-1][1]:.0f} MiB", flush=True)

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    await client.close()
    return {"stats": dict(stats), "rss": rss, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `cbgen serve` argument")
    args = parser.parse_args()

    port = _free_port()
    log_path = Path(f"/tmp/cbgen-soak-{port}.log")
    proc = start_server(args.model, port, log_path, args.server_arg)
    url = f"http://127.0.0.1:{port}"
    try:
        result = asyncio.run(soak(url, proc.pid, args.requests, args.concurrency, args.seed))
        # Disconnected streams are aborted by the server as it notices; give it a moment to settle.
        deadline = time.monotonic() + 60
        while True:
            metrics = httpx.get(url + "/metrics", timeout=10).text
            in_flight = _metric(metrics, "cbgen_num_requests_in_flight")
            free, blocks = _metric(metrics, "cbgen_num_free_blocks"), _metric(metrics, "cbgen_num_blocks")
            if (in_flight == 0 and free == blocks) or time.monotonic() > deadline:
                break
            time.sleep(1)
        result.update(in_flight=in_flight, free_blocks=free, num_blocks=blocks, alive=proc.poll() is None)
        rss = [r for _, r in result["rss"]]
        warm = rss[len(rss) // 4] if rss else float("nan")
        result["rss_after_warmup_mib"], result["rss_end_mib"] = warm, rss[-1] if rss else float("nan")
        errors = {k: v for k, v in result["stats"].items() if k.startswith("error:")}
        result["ok"] = not errors and in_flight == 0 and free == blocks and result["alive"]
        print(json.dumps({k: v for k, v in result.items() if k != "rss"}, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        sys.exit(0 if result["ok"] else 1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
