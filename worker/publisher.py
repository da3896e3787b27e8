"""Publishing: result and dead-letter records sized to the record limit, delivered with acks and retries."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord

from schemas import (
    HEADER_ERROR_CODE,
    HEADER_ERROR_MESSAGE,
    ErrorCode,
    ScoreResult,
    encode_result,
    result_headers,
)
from worker.config import WorkerSettings
from worker.errors import PublishError

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]

# Retries back off from 0.4 s, doubling, to at most this: a long outage costs a request every few seconds.
_MAX_BACKOFF_S = 5.0
# The broker refuses a record above its own size limit (lower than ours): such a record is never sent as is.
_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)
# DLQ headers are for people reading the topic; a traceback-sized message does not belong there (bytes).
_MAX_HEADER_MESSAGE = 1000


@dataclass(frozen=True)
class OutRecord:
    """One record to publish."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    # What the record carries, for the metrics: the result encoded in it, or the dead-letter reason.
    result: ScoreResult | None = None
    dead_letter_reason: str | None = None
    # The smallest form of the same answer (error result without metadata, dead letter without value), sent
    # instead when the broker refuses this one as too large.
    fallback: OutRecord | None = None


def record_size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """The size aiokafka checks against max_request_size (raising MessageSizeTooLargeError above it)."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers))


def result_record(settings: WorkerSettings, key: bytes | None, result: ScoreResult) -> OutRecord:
    """The result as a record keyed like its request; above the record limit, a RESULT_TOO_LARGE error."""
    headers = result_headers(result.request_id)
    return _first_within(settings.max_record_bytes, _result_candidates(settings, key, result, headers))


def _result_candidates(
    settings: WorkerSettings, key: bytes | None, result: ScoreResult, headers: Headers
) -> Iterator[OutRecord]:
    topic = settings.results_topic
    value = encode_result(result)
    yield OutRecord(topic, key, value, headers, result)
    size, limit = record_size(key, value, headers), settings.max_record_bytes
    message = (
        f"the result is {size} bytes, above the record limit of {limit} bytes (max_record_bytes); "
        "send fewer items or less metadata per request, ask for float16/bfloat16 hidden states, "
        "or raise the limit"
    )
    failure = ScoreResult.failure(
        result.request_id, ErrorCode.RESULT_TOO_LARGE, message, model=result.model, metadata=result.metadata
    )
    yield OutRecord(topic, key, encode_result(failure), headers, failure)
    # The echoed metadata, then the key, can be what breaks the limit on their own. Without them the
    # result always fits; a record that can never be sent would stop the worker at it on every restart.
    bare_failure = dataclasses.replace(failure, metadata=None)
    bare = encode_result(bare_failure)
    yield OutRecord(topic, key, bare, headers, bare_failure)
    yield OutRecord(topic, None, bare, headers, bare_failure)


def dead_letter_record(
    settings: WorkerSettings, record: ConsumerRecord[bytes, bytes], code: ErrorCode, message: str
) -> OutRecord:
    """A copy of a rejected request record (key, value, headers) plus the reason and where it came from.

    Above the record limit the copy loses, in turn, its value, the request's headers and its key: the
    reason and the source position always remain, so the record can be found in the requests topic.
    """
    reason: Headers = [
        (HEADER_ERROR_CODE, str(code).encode()),
        (HEADER_ERROR_MESSAGE, _shorten_utf8(message, _MAX_HEADER_MESSAGE)),
        ("x-source-topic", record.topic.encode()),
        ("x-source-partition", str(record.partition).encode()),
        ("x-source-offset", str(record.offset).encode()),
    ]
    topic, key, value, headers = settings.dlq_topic, record.key, record.value, list(record.headers)
    no_value = [("x-value-omitted-bytes", str(len(value or b"")).encode())]
    header_bytes = sum(len(name.encode()) + len(data or b"") for name, data in headers)
    no_headers = [("x-headers-omitted-bytes", str(header_bytes).encode())]
    why = str(code)
    candidates = [
        OutRecord(topic, key, value, headers + reason, dead_letter_reason=why),
        # An empty value, not none: a Kafka record needs a key or a value, and the source may have no key.
        OutRecord(topic, key, b"", headers + reason + no_value, dead_letter_reason=why),
        OutRecord(topic, key, b"", reason + no_value + no_headers, dead_letter_reason=why),
        OutRecord(topic, None, b"", reason + no_value + no_headers, dead_letter_reason=why),
    ]
    return _first_within(settings.max_record_bytes, candidates)


def _shorten_utf8(text: str, max_bytes: int) -> bytes:
    """At most `max_bytes` of UTF-8, cut on a character boundary (a message may quote any characters)."""
    return text.encode("utf-8", errors="replace")[:max_bytes].decode("utf-8", errors="ignore").encode()


def _first_within(limit: int, candidates: Iterable[OutRecord]) -> OutRecord:
    """The first candidate within the size limit, else the last (smallest) one; the smallest is kept as the
    fallback of a larger choice."""
    options = list(candidates)
    smallest = options[-1]
    for candidate in options:
        if record_size(candidate.key, candidate.value, candidate.headers) <= limit:
            return candidate if candidate is smallest else dataclasses.replace(candidate, fallback=smallest)
    return smallest


class Publisher:
    """The worker's producer: acks="all", no idempotence (Tansu lacks InitProducerId), batches raised."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._retry_s = settings.publish_timeout_ms / 1000
        # max_batch_size follows the record limit so results share produce requests instead of each result
        # above the 16 KiB default travelling alone.
        self._producer = AIOKafkaProducer(
            **settings.kafka_client_kwargs(),
            acks="all",
            linger_ms=2,
            max_batch_size=settings.max_record_bytes,
            max_request_size=settings.max_record_bytes,
            enable_idempotence=False,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush what is buffered, then close."""
        await self._producer.stop()

    async def deliver(self, records: Sequence[OutRecord]) -> None:
        """Send and wait for the broker's acknowledgement of every record, retrying the failed ones.

        Raises PublishError after the last attempt: the caller must not mark those records done.
        """
        pending = list(records)
        give_up_at = time.monotonic() + self._retry_s
        attempt = 0
        while True:
            attempt += 1
            outcomes = await self._send_all(pending)
            failed = [(r, o) for r, o in zip(pending, outcomes, strict=True) if isinstance(o, BaseException)]
            retry = [_smaller(record, error) for record, error in failed]
            pending = [record for record in retry if record is not None]
            if not pending:
                return
            error = next((o for _, o in failed if _retriable(o)), None)
            if error is None:  # only smaller forms to send: no reason to wait
                continue
            if attempt == 1 or attempt % 10 == 0:  # a long outage: one line now and then, not one per try
                log.warning(
                    "%d of %d sends failed (attempt %d): %r", len(failed), len(outcomes), attempt, error
                )
            if time.monotonic() >= give_up_at:
                raise PublishError(
                    f"could not deliver {len(pending)} records to {pending[0].topic} within "
                    f"{self._retry_s:.0f} s (publish_timeout_ms): {error!r}"
                )
            await asyncio.sleep(min(_MAX_BACKOFF_S, 0.2 * 2**attempt))

    async def _send_all(self, records: list[OutRecord]) -> list[object]:
        """Enqueue in order (keeps per-partition order), then wait for all acks; exceptions are returned."""
        acks: list[asyncio.Future[object]] = []
        for record in records:
            try:
                acks.append(
                    await self._producer.send(record.topic, record.value, record.key, headers=record.headers)
                )
            except Exception as exc:  # the client refusing one record must not stop the others
                failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                acks.append(failed)
        return list(await asyncio.gather(*acks, return_exceptions=True))


def _retriable(error: BaseException) -> bool:
    """A failure the same record may get past later (the broker away, a leader moving); a record refused as
    too large, or by the client itself, never will."""
    return isinstance(error, KafkaError) and not isinstance(error, _TOO_LARGE)


def _smaller(record: OutRecord, error: BaseException) -> OutRecord | None:
    """What to send again after `error`: the record itself (the broker is away), its smallest form when the
    broker or the client refused this one, or None when even that is refused (logged: retrying it would
    stop the worker on it on every restart)."""
    if _retriable(error):
        return record
    if record.fallback is not None:
        log.warning("a %s record was refused (%r); sending its smallest form", record.topic, error)
        return record.fallback
    log.error("even the smallest %s record is refused (%r); it is dropped", record.topic, error)
    return None
