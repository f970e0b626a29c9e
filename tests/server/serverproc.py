"""A ``cbgen serve`` subprocess for the end-to-end tests, and readers of its ``/metrics``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``cbgen serve`` subprocess with ``args`` after its model and port; ``ensure_running()``
    (re)starts it if it is not up."""

    def __init__(self, model_path: Path, log_dir: Path, name: str, args: list[str]) -> None:
        self.model_path = model_path
        self.log_path = log_dir / f"{name}.log"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def ensure_running(self) -> ServerProcess:
        if self.proc is not None and self.proc.poll() is None:
            return self
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable, "-m", "cbgen.cli", "serve",
            "--model", str(self.model_path),
            "--port", str(port),
            *self.args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        env.pop("CBGEN_API_KEY", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child for its whole life
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        labels = key[len(name) :]
        reason = re.search(r'finished_reason="(\w+)"', labels)
        out[name + (f":{reason.group(1)}" if reason else "")] = float(value)
    return out


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """Polls /metrics until no sequence runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (
            m["cbgen_num_requests_running"] == 0
            and m["cbgen_num_requests_waiting"] == 0
            and m["cbgen_num_requests_in_flight"] == 0
            and m["cbgen_num_free_blocks"] == m["cbgen_num_blocks"]
        )
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.05)


class HealthProbe:
    """Context manager: a thread that asks for ``/health`` every ``interval`` seconds, recording each
    answer's latency, and as failures any error or status other than 200."""

    def __init__(self, url: str, interval: float = 0.05, keep_alive: bool = False) -> None:
        self.url = url
        self.interval = interval
        self.keep_alive = keep_alive  # one connection for every probe, or a new one each time
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    if self.keep_alive:
                        status = http.get(self.url + "/health").status_code
                    else:
                        status = httpx.get(self.url + "/health", timeout=30).status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - start)
                if status != 200:
                    self.failures.append(f"status {status}")
                time.sleep(self.interval)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def flood_chat(url: str, raw: bytes, refusal: str, stop: threading.Event, answered: list[float]) -> None:
    """Posts ``raw`` to the chat endpoint back to back until ``stop``, each answer a 400 whose
    message holds ``refusal``, and records each one's seconds in ``answered``; run it on a thread.

    A real flooder's CPU is on its own machine; on a 2-core test box its sending would compete with
    the server, which is not what the latency tests measure, so the thread runs at nice 19.  A
    wrong answer fails the assertion and ends the thread, which the tests check with ``is_alive``."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            start = time.perf_counter()
            r = http.post(
                url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and refusal in r.json()["error"]["message"], r.text
            answered.append(time.perf_counter() - start)
