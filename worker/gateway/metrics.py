"""The gateway's own Prometheus series: calls by route and status, their latency, what is in flight."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "score_gateway"
# From a cached small call (about a millisecond over Kafka) to the longest a call may wait by default.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """One registry per gateway (a test may run several in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        r = self.registry
        self.calls = Counter(
            f"{PREFIX}_requests", "HTTP calls answered, by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            f"{PREFIX}_request_seconds", "time from a call's arrival to its answer, by route", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(f"{PREFIX}_in_flight", "calls being handled now", registry=r)
        self.waiting = Gauge(
            f"{PREFIX}_kafka_waiting", "calls waiting for their results on Kafka", registry=r
        )
        self.answering = Gauge(
            f"{PREFIX}_workers_answering",
            "1 while a worker answers this gateway's requests, else 0",
            registry=r,
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        # The children of each route and status, looked up once: labels() takes a lock and builds a key.
        children = self._children.get((route, status))
        if children is None:
            children = self._children[route, status] = (
                self.calls.labels(route, str(status)),
                self.latency.labels(route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
