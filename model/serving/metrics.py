"""`GET /metrics`: the server's counters in Prometheus' text format, kept by prometheus-client.

Per request (the HTTP side): `tinyllm_requests_total{route, status}`, prompt and generated
tokens, time to first token and time per generated token after it (histograms). Read from the
engine at each scrape: the queue length, the busy rows, and the prefix cache's hits and the
prompt tokens it saved.

    >>> metrics = ServeMetrics(lambda: {"queue_length": 0, "active": 0, "batch_rows": 4,
    ...                                 "prefix_hits": 2, "reused_tokens": 40})
    >>> b"tinyllm_prefix_cache_hits_total 2.0" in metrics.render()[0]
    True
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: from a few ms (a tiny model's step) to a long queue wait.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class ServeMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tinyllm_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tinyllm_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generated_tokens = Counter(
            "tinyllm_generated_tokens", "Tokens generated", registry=self.registry
        )
        self.first_token = Histogram(
            "tinyllm_time_to_first_token_seconds",
            "From a request's arrival in the queue to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.per_token = Histogram(
            "tinyllm_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats))

    def finished(self, prompt_tokens: int, generated: int, first_s: float | None, rest_s: float):
        """A request's tokens and latencies, once it is done."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        if first_s is not None:
            self.first_token.observe(first_s)
        if generated > 1:
            self.per_token.observe(rest_s / (generated - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """The engine's own counts, read at each scrape."""

    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.engine_stats = engine_stats

    def collect(self):
        stats = self.engine_stats()
        gauges = {
            "tinyllm_queue_length": ("Requests waiting for a batch row", "queue_length"),
            "tinyllm_busy_rows": ("Batch rows decoding a request", "active"),
            "tinyllm_batch_rows": ("Batch rows in all", "batch_rows"),
        }
        for name, (help_text, key) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=stats[key])
        yield CounterMetricFamily(
            "tinyllm_prefix_cache_hits",
            "Requests that reused a kept prompt prefix's K/V",
            value=stats["prefix_hits"],
        )
        yield CounterMetricFamily(
            "tinyllm_prefix_cache_reused_tokens",
            "Prompt tokens not prefilled thanks to a kept prefix",
            value=stats["reused_tokens"],
        )
