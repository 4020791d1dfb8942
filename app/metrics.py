"""Prometheus metrics, one CollectorRegistry per app (several apps in one process do not clash)."""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# no `*_created` timestamp series next to every counter and histogram: they only add noise to scrapes
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gpt_requests_total", "Generation requests by HTTP status and finish reason",
                                ["status", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("gpt_prompt_tokens_total", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("gpt_generated_tokens_total", "Tokens generated", registry=r)
        self.queue_size = Gauge("gpt_queue_size", "Requests waiting for a KV-cache slot", registry=r)
        self.batch_size = Gauge("gpt_batch_size", "Sequences holding a KV-cache slot (prefilling or decoding)",
                                registry=r)
        self.queue_time = Histogram("gpt_queue_time_seconds", "Time from arrival to a KV-cache slot",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("gpt_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gpt_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("gpt_request_latency_seconds", "Time from arrival to the last token or error",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def bind_engine(self, queue_size: Callable[[], float], batch_size: Callable[[], float]) -> None:
        """The gauges read the engine's live numbers at scrape time."""
        self.queue_size.set_function(queue_size)
        self.batch_size.set_function(batch_size)

    def count_request(self, status: int | str, finish_reason: str) -> None:
        self.requests.labels(status=str(status), finish_reason=finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
