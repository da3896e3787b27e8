"""Kafka record headers of requests, results and dead-lettered messages."""

from __future__ import annotations

from collections.abc import Iterable

from schemas._checks import is_valid_request_id
from schemas.version import SCHEMA_VERSION

Headers = list[tuple[str, bytes]]  # aiokafka's form

HEADER_REQUEST_ID = "x-request-id"
HEADER_CONTENT_TYPE = "content-type"
HEADER_SCHEMA_VERSION = "x-schema-version"
HEADER_ERROR_CODE = "x-error-code"
HEADER_ERROR_MESSAGE = "x-error-message"
# Where a dead-letter record's source lies: topic, partition, offset (the first, for a range) and, for a
# range of records skipped unread, the last offset and the cause.
HEADER_SOURCE_TOPIC = "x-source-topic"
HEADER_SOURCE_PARTITION = "x-source-partition"
HEADER_SOURCE_OFFSET = "x-source-offset"
HEADER_SOURCE_LAST_OFFSET = "x-source-last-offset"
HEADER_UNDECODABLE_CAUSE = "x-undecodable-cause"
# Request-reply, as Spring Kafka's ReplyingKafkaTemplate writes them (KafkaHeaders.REPLY_TOPIC and
# CORRELATION_ID): the topic the result should go to, and a correlation value copied onto the result.
HEADER_REPLY_TOPIC = "kafka_replyTopic"
HEADER_CORRELATION_ID = "kafka_correlationId"

REQUEST_CONTENT_TYPE = f"application/vnd.score-worker.request.v{SCHEMA_VERSION}+msgpack"
RESULT_CONTENT_TYPE = f"application/vnd.score-worker.result.v{SCHEMA_VERSION}+msgpack"


def _headers(request_id: str, content_type: str) -> Headers:
    return [
        (HEADER_REQUEST_ID, request_id.encode("utf-8")),
        (HEADER_CONTENT_TYPE, content_type.encode("ascii")),
        (HEADER_SCHEMA_VERSION, str(SCHEMA_VERSION).encode("ascii")),
    ]


def request_headers(request_id: str) -> Headers:
    """Headers a producer puts on a request record."""
    return _headers(request_id, REQUEST_CONTENT_TYPE)


def result_headers(request_id: str) -> Headers:
    """Headers the worker puts on a result record."""
    return _headers(request_id, RESULT_CONTENT_TYPE)


def header_value(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    """The value of the first header called `name` (in any case); None when absent or null."""
    wanted = name.lower()
    for key, value in headers or ():
        if key.lower() == wanted:
            return value
    return None


def headers_to_dict(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, bytes]:
    """Headers as a dict: names lower-cased, a null value read as b"", the last of repeated names wins."""
    return {name.lower(): value or b"" for name, value in headers or ()}


def header_request_id(headers: Iterable[tuple[str, bytes | None]] | None) -> str | None:
    """The first x-request-id header (name in any case) as text; None when absent, not UTF-8 or no usable
    request id (1 to 256 characters), as an id in the map would have to be."""
    for name, value in headers or ():
        if name.lower() == HEADER_REQUEST_ID and value:
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return text if is_valid_request_id(text) else None
    return None
