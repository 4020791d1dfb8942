"""Prometheus metrics, one CollectorRegistry per app (several apps in one process do not clash).

Request outcomes and latencies are counted by the HTTP fronts; the engine's own numbers (queue, batch, tokens,
steps) come from the engine core's stats, which reach every front with each step's message. With several front
processes (GPT_API_SERVERS > 1) the launcher sets PROMETHEUS_MULTIPROC_DIR and each front's counters and
histograms live in prometheus-client's multiprocess files, so any front's /metrics adds up all of them; the
engine's numbers are reported once, from the core's stats.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# no `*_created` timestamp series next to every counter and histogram: they only add noise to scrapes
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class EngineCollector:
    """The engine core's stats (as of its last message to this front) as Prometheus series."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self.stats() or {}
        computed, hit = s.get("prompt_tokens", 0), s.get("prefix_hit_tokens", 0)
        yield CounterMetricFamily("gpt_prompt_tokens", "Prompt tokens prefilled (computed)", value=computed)
        yield CounterMetricFamily("gpt_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache "
                                  "(not computed)", value=hit)
        yield GaugeMetricFamily("gpt_prefix_cache_hit_rate", "Share of all prompt tokens so far that were reused "
                                "from the prefix cache", value=hit / (hit + computed) if hit + computed else 0.0)
        yield CounterMetricFamily("gpt_generated_tokens", "Tokens generated", value=s.get("generated_tokens", 0))
        yield CounterMetricFamily("gpt_decode_steps", "Engine decode steps", value=s.get("decode_steps", 0))
        spec = s.get("speculative")
        if spec:  # speculative decoding is on (GPT_SPECULATIVE): proposals and how many the target's draws kept
            method = spec.get("method", "")
            for name, key, text in (
                    ("gpt_spec_proposed_tokens", "proposed_tokens", "Tokens proposed by speculative decoding"),
                    ("gpt_spec_accepted_tokens", "accepted_tokens", "Proposed tokens that were the target's own "
                                                                   "draws (emitted without a step of their own)")):
                m = CounterMetricFamily(name, text, labels=["method"])
                m.add_metric([method], spec.get(key, 0))
                yield m
            rate = GaugeMetricFamily("gpt_spec_acceptance_rate", "Share of proposed tokens accepted, since start",
                                     labels=["method"])
            rate.add_metric([method], spec.get("acceptance_rate") or 0.0)
            yield rate
        yield GaugeMetricFamily("gpt_queue_size", "Requests waiting for a KV-cache slot", value=s.get("queued", 0))
        yield GaugeMetricFamily("gpt_batch_size", "Sequences holding a KV-cache slot (prefilling or decoding)",
                                value=s.get("running", 0))


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gpt_requests_total", "Generation requests by HTTP status and finish reason",
                                ["status", "finish_reason"], registry=r)
        self.queue_time = Histogram("gpt_queue_time_seconds", "Time from arrival to a KV-cache slot",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("gpt_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gpt_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("gpt_request_latency_seconds", "Time from arrival to the last token or error",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._engine: EngineCollector | None = None

    def bind_engine(self, stats: Callable[[], dict]) -> None:
        """The engine series read the core's latest stats at scrape time."""
        self._engine = EngineCollector(stats)
        self.registry.register(self._engine)

    def count_request(self, status: int | str, finish_reason: str) -> None:
        self.requests.labels(status=str(status), finish_reason=finish_reason).inc()

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        if self._engine is not None:
            registry.register(self._engine)
        return generate_latest(registry)
