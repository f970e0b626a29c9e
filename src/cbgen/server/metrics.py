"""Prometheus metrics for the server, in a private ``CollectorRegistry``.

A private registry keeps several apps in one process (tests, embedding) from colliding on the global
one.  Engine-side numbers (queue sizes, KV cache, token counters) are read from the AsyncEngine's
snapshot at scrape time, so the engine thread never touches prometheus objects; latencies are observed
by the request handlers on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cbgen.async_engine import AsyncEngine
from cbgen.server.connections import ConnectionGuard

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)


class _EngineCollector(Collector):
    """Turns one :meth:`AsyncEngine.stats` snapshot into gauges and counters per scrape."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("cbgen_num_requests_running", "Sequences in the running batch.", s.running)
        yield gauge("cbgen_num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting)
        yield gauge("cbgen_num_requests_in_flight", "Requests submitted and not yet finished.", s.in_flight)
        yield gauge("cbgen_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage)
        yield gauge("cbgen_num_free_blocks", "Free KV-cache blocks.", s.num_free_blocks)
        yield gauge("cbgen_num_blocks", "Total KV-cache blocks.", s.num_blocks)
        yield gauge(
            "cbgen_prefix_cache_hit_rate",
            "Fraction of looked-up prompt tokens served from the prefix cache (since start).",
            s.prefix_cache_hit_rate,
        )
        yield gauge("cbgen_engine_paused", "1 while the engine loop is paused.", float(s.paused))
        yield gauge(
            "cbgen_num_requests_paused",
            "Requests paused because their client stopped reading.",
            s.streams_paused,
        )
        yield gauge(
            "cbgen_inflight_work_tokens",
            "Token slots (n x (prompt + max_tokens)) of the requests in flight.",
            s.inflight_work,
        )
        yield counter("cbgen_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("cbgen_generation_tokens", "Generated tokens.", s.generated_tokens)
        yield counter("cbgen_num_preemptions", "Sequences preempted for lack of KV blocks.", s.preemptions)
        yield counter("cbgen_engine_step_errors", "Engine steps that raised.", s.step_errors)


class _ConnectionCollector(Collector):
    """Open connections and what the connection guard refused, evicted or timed out."""

    def __init__(self, guard: ConnectionGuard, model_name: str) -> None:
        self._guard = guard
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("cbgen_open_connections", "Open HTTP connections.", labels=["model_name"])
        g.add_metric([self._model], self._guard.open)
        yield g
        c = CounterMetricFamily(
            "cbgen_connection_events",
            "Connections refused or evicted at the cap, and closed by a header or write timeout.",
            labels=["model_name", "event"],
        )
        for event, count in sorted(self._guard.counts.items()):
            c.add_metric([self._model, event], count)
        yield c


class ServerMetrics:
    """Every metric the server exports; ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        self.request_success = Counter(
            "cbgen_request_success",
            "Finished sequences (choices) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "cbgen_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "cbgen_inter_token_latency_seconds",
            "Time between consecutive token deliveries of one request, per token.",
            ["model_name"],
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "cbgen_e2e_request_latency_seconds",
            "From request arrival to its last output.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch_connections(self, guard: ConnectionGuard) -> None:
        """Exports the connection guard's gauge and counters too."""
        self.registry.register(_ConnectionCollector(guard, self.model_name))

    def observe_finish(self, reason: str) -> None:
        """Counts one finished choice."""
        self.request_success.labels(self.model_name, reason).inc()

    def observe_ttft(self, seconds: float) -> None:
        """Records a time to first token."""
        self.time_to_first_token.labels(self.model_name).observe(seconds)

    def observe_itl(self, seconds: float, tokens: int) -> None:
        """Records the gap before a delivery of ``tokens`` tokens, spread over those tokens."""
        per_token = seconds / max(tokens, 1)
        child = self.inter_token_latency.labels(self.model_name)
        for _ in range(max(tokens, 1)):
            child.observe(per_token)

    def observe_e2e(self, seconds: float) -> None:
        """Records an end-to-end request latency."""
        self.e2e_latency.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
