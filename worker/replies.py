"""Where a request's result goes: the results topic, or the reply topic the request names.

A request may name a reply topic in the `kafka_replyTopic` header and carry a `kafka_correlationId` header:
the names Spring Kafka's ReplyingKafkaTemplate writes, so such clients work unchanged. The worker writes
the result to that topic only when the name matches its `reply_topic_pattern`; anything else gets a
REPLY_TOPIC_NOT_ALLOWED error result on the results topic, never a write to a topic a producer picked. The
correlation header is copied onto the result, wherever it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas import HEADER_CORRELATION_ID, HEADER_REPLY_TOPIC, Headers, header_value
from worker.config import WorkerSettings, is_topic_name

_MAX_CORRELATION_BYTES = 1024  # copied onto every result: a correlation id, not a payload


@dataclass(frozen=True)
class Route:
    """Where one request's result goes and what it carries from the request's headers."""

    topic: str | None = None  # a reply topic; None: the results topic
    headers: Headers = field(default_factory=list)  # copied from the request onto its result
    refusal: str | None = None  # why the named reply topic is refused (the result then says so)


DEFAULT_ROUTE = Route()


class ReplyPolicy:
    """Reads a request record's reply headers against the worker's settings."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        pattern = settings.reply_topic_pattern
        self._allowed = re.compile(pattern) if pattern else None

    def route(self, headers: Headers | None) -> Route:
        correlation = header_value(headers, HEADER_CORRELATION_ID)
        echoed: Headers = []
        if correlation is not None and len(correlation) <= _MAX_CORRELATION_BYTES:
            echoed = [(HEADER_CORRELATION_ID, correlation)]
        raw = header_value(headers, HEADER_REPLY_TOPIC)
        if not raw:
            return Route(headers=echoed) if echoed else DEFAULT_ROUTE
        refusal = self._refusal(raw)
        if refusal is not None:
            return Route(headers=echoed, refusal=refusal)
        topic = raw.decode("ascii")
        return Route(None if topic == self._settings.results_topic else topic, echoed)

    def _refusal(self, raw: bytes) -> str | None:
        settings = self._settings
        try:
            topic = raw.decode("ascii")
        except UnicodeDecodeError:
            topic = ""
        if not is_topic_name(topic):
            shown = raw[:64].decode("utf-8", errors="replace")
            return (
                f"the {HEADER_REPLY_TOPIC} header {shown!r} is not a Kafka topic name (1 to 249 letters, "
                "digits, '.', '_', '-')"
            )
        if topic == settings.results_topic:
            return None
        if topic in {settings.requests_topic, settings.dlq_topic}:
            return (
                f"the reply topic {topic!r} is this worker's requests or dead-letter topic; name a reply "
                "topic of your own"
            )
        if self._allowed is None or not self._allowed.fullmatch(topic):
            allowed = "none" if self._allowed is None else f"names matching {self._allowed.pattern!r}"
            return (
                f"the reply topic {topic!r} is not one this worker writes to (reply_topic_pattern allows "
                f"{allowed}); name an allowed topic, or leave {HEADER_REPLY_TOPIC} out to read the results "
                f"on {settings.results_topic!r}"
            )
        return None
