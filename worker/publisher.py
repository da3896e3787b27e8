"""Publishing: result and dead-letter records sized to the record limit, delivered with acks and retries."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordTooLargeError,
    for_code,
)
from aiokafka.protocol.transaction import InitProducerIdRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord, TopicPartition

from schemas import (
    HEADER_ERROR_CODE,
    HEADER_ERROR_MESSAGE,
    HEADER_REPLY_TOPIC,
    HEADER_SOURCE_LAST_OFFSET,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_UNDECODABLE_CAUSE,
    ErrorCode,
    ScoreResult,
    encode_result,
    result_headers,
)
from worker.codecs import producer_compression
from worker.config import WorkerSettings
from worker.errors import PublishError
from worker.replies import DEFAULT_ROUTE, Route

log = logging.getLogger(__name__)
T = TypeVar("T")

Headers = list[tuple[str, bytes]]

# Retries back off from 0.4 s, doubling, to at most this: a long outage costs a request every few seconds.
_MAX_BACKOFF_S = 5.0
# The broker refuses a record above its own size limit (lower than ours): such a record is never sent as is.
_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)
# DLQ headers are for people reading the topic; a traceback-sized message does not belong there (bytes).
_MAX_HEADER_MESSAGE = 1000
# Whether a reply topic exists: asked of the brokers at most this often per topic (a topic that exists
# is re-checked rarely; a missing one soon, as a client may be creating it).
_TOPIC_KNOWN_S = 300.0
_TOPIC_MISSING_S = 10.0
_TOPIC_CHECK_TIMEOUT_S = 10.0


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
    # Builds the smallest form of the same answer (error result without metadata, dead letter without
    # value), sent instead when the broker refuses this one as too large: built only then.
    make_fallback: Callable[[], OutRecord] | None = None
    # For a result bound for a reply topic: builds what is sent instead when that topic does not exist (an
    # error result on the results topic), only then.
    make_if_topic_missing: Callable[[], OutRecord] | None = None

    def fallback(self) -> OutRecord | None:
        """The smallest form of the same answer; None when this is it."""
        return None if self.make_fallback is None else self.make_fallback()


def record_size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """The size aiokafka checks against max_request_size (raising MessageSizeTooLargeError above it)."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers))


def result_record(
    settings: WorkerSettings, key: bytes | None, result: ScoreResult, route: Route = DEFAULT_ROUTE
) -> OutRecord:
    """The result as a record keyed like its request, on the topic its route names; above the record limit,
    a RESULT_TOO_LARGE error."""
    headers = result_headers(result.request_id) + route.headers
    topic = route.topic or settings.results_topic
    record = _sized_result(settings, key, result, headers, topic)
    if route.topic is None:
        return record

    def missing() -> OutRecord:
        message = (
            f"the reply topic {route.topic!r} does not exist on the brokers; create it before sending "
            f"requests that name it (the worker never creates it), or leave {HEADER_REPLY_TOPIC} out"
        )
        failure = _failure_instead(result, ErrorCode.REPLY_TOPIC_NOT_ALLOWED, message)
        return result_record(settings, key, failure, dataclasses.replace(route, topic=None))

    return dataclasses.replace(record, make_if_topic_missing=_once(missing))


def _once(build: Callable[[], T]) -> Callable[[], T]:
    """`build`, called the first time the result is asked for; the same result every time after."""
    built: list[T] = []

    def get() -> T:
        if not built:
            built.append(build())
        return built[0]

    return get


def _failure_instead(result: ScoreResult, code: ErrorCode, message: str) -> ScoreResult:
    """The error result sent in place of `result`, for the same request, model and metadata."""
    return ScoreResult.failure(result.request_id, code, message, model=result.model, metadata=result.metadata)


def _sized_result(
    settings: WorkerSettings, key: bytes | None, result: ScoreResult, headers: Headers, topic: str
) -> OutRecord:
    """The result's record, or in its place the first of ever smaller error records within the limit."""
    value = encode_result(result)

    def smaller() -> list[OutRecord]:
        size, limit = record_size(key, value, headers), settings.max_record_bytes
        message = (
            f"the result is {size} bytes, above the record limit of {limit} bytes (max_record_bytes); "
            "send fewer items or less metadata per request, ask for float16/bfloat16 hidden states, "
            "or raise the limit"
        )
        failure = _failure_instead(result, ErrorCode.RESULT_TOO_LARGE, message)
        # The echoed metadata, then the key, can be what breaks the limit on their own. Without them the
        # result always fits; a record that can never be sent would stop the worker at it on every restart.
        bare_failure = dataclasses.replace(failure, metadata=None)
        bare = encode_result(bare_failure)
        return [
            OutRecord(topic, key, encode_result(failure), headers, failure),
            OutRecord(topic, key, bare, headers, bare_failure),
            OutRecord(topic, None, bare, headers, bare_failure),
        ]

    return _first_within(
        settings.max_record_bytes,
        lambda fallback: OutRecord(topic, key, value, headers, result, make_fallback=fallback),
        smaller,
    )


def dead_letter_record(
    settings: WorkerSettings, record: ConsumerRecord[bytes, bytes], code: ErrorCode, message: str
) -> OutRecord:
    """A copy of a rejected request record (key, value, headers) plus the reason and where it came from.

    Above the record limit the copy loses, in turn, its value, the request's headers and its key: the
    reason and the source position always remain, so the record can be found in the requests topic.
    """
    reason = _reason(code, message, TopicPartition(record.topic, record.partition), record.offset)
    topic, key, value, headers = settings.dlq_topic, record.key, record.value, list(record.headers)
    no_value = [("x-value-omitted-bytes", str(len(value or b"")).encode())]
    header_bytes = sum(len(name.encode()) + len(data or b"") for name, data in headers)
    no_headers = [("x-headers-omitted-bytes", str(header_bytes).encode())]
    why = str(code)
    return _first_within(
        settings.max_record_bytes,
        lambda fallback: OutRecord(
            topic, key, value, headers + reason, dead_letter_reason=why, make_fallback=fallback
        ),
        # An empty value, not none: a Kafka record needs a key or a value, and the source may have no key.
        lambda: [
            OutRecord(topic, key, b"", headers + reason + no_value, dead_letter_reason=why),
            OutRecord(topic, key, b"", reason + no_value + no_headers, dead_letter_reason=why),
            OutRecord(topic, None, b"", reason + no_value + no_headers, dead_letter_reason=why),
        ],
    )


def unreadable_record(
    settings: WorkerSettings,
    tp: TopicPartition,
    first: int,
    last: int,
    cause: str,
    message: str,
    batch: bytes | None,
) -> OutRecord:
    """The dead-letter record of offsets `first` to `last`, skipped because they could not be read: the
    batch as the broker stores it (to decode elsewhere, where its codec is at hand), the reason, the cause
    and the source range. Above the record limit the batch is left out; the range and reason remain."""
    code = ErrorCode.UNDECODABLE_RECORDS
    reason = [
        *_reason(code, message, tp, first),
        (HEADER_SOURCE_LAST_OFFSET, str(last).encode()),
        (HEADER_UNDECODABLE_CAUSE, cause.encode()),
    ]
    value = batch or b""
    no_value = [("x-value-omitted-bytes", str(len(value)).encode())]
    why = str(code)
    return _first_within(
        settings.max_record_bytes,
        lambda fallback: OutRecord(
            settings.dlq_topic, None, value, reason, dead_letter_reason=why, make_fallback=fallback
        ),
        lambda: [OutRecord(settings.dlq_topic, None, b"", reason + no_value, dead_letter_reason=why)],
    )


def _reason(code: ErrorCode, message: str, tp: TopicPartition, offset: int) -> Headers:
    """The headers every dead-letter record carries: why, and where its source lies."""
    return [
        (HEADER_ERROR_CODE, str(code).encode()),
        (HEADER_ERROR_MESSAGE, _shorten_utf8(message, _MAX_HEADER_MESSAGE)),
        (HEADER_SOURCE_TOPIC, tp.topic.encode()),
        (HEADER_SOURCE_PARTITION, str(tp.partition).encode()),
        (HEADER_SOURCE_OFFSET, str(offset).encode()),
    ]


def _shorten_utf8(text: str, max_bytes: int) -> bytes:
    """At most `max_bytes` of UTF-8, cut on a character boundary (a message may quote any characters)."""
    return text.encode("utf-8", errors="replace")[:max_bytes].decode("utf-8", errors="ignore").encode()


def _first_within(
    limit: int,
    first: Callable[[Callable[[], OutRecord]], OutRecord],
    smaller: Callable[[], list[OutRecord]],
) -> OutRecord:
    """The first record (built by `first`, given its fallback) if within the size limit, else the first of
    the `smaller` ones within it, else the last (smallest). The smaller ones are built only when needed:
    for a record that fits, once the broker refuses it; nearly every record fits, and a batch's results
    are encoded between two forward passes."""
    options = _once(smaller)

    def fallback() -> OutRecord:
        return options()[-1]

    record = first(fallback)
    if record_size(record.key, record.value, record.headers) <= limit:
        return record
    *larger, smallest = options()
    for candidate in larger:
        if record_size(candidate.key, candidate.value, candidate.headers) <= limit:
            return dataclasses.replace(candidate, make_fallback=fallback)
    return smallest


async def broker_grants_producer_ids(client_kwargs: dict[str, Any], timeout_s: float = 30.0) -> bool:
    """Whether the brokers give out producer ids (InitProducerId), which an idempotent producer needs.

    Apache Kafka does (since 0.11); the embedded broker (Tansu) answers UnknownError. Asked once, with a
    client of its own, before the producer is built (aiokafka fixes idempotence at construction).
    """
    client = AIOKafkaClient(**client_kwargs)
    request = InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=60_000)
    deadline = time.monotonic() + timeout_s
    try:
        await client.bootstrap()
        while True:
            response = await client.send(client.get_random_node(), request)
            code = int(response.error_code)
            if code == 0:
                return True
            # A fresh cluster answers "coordinator loading / not available" while it creates and loads
            # its transaction log: ask again. Anything else (UnknownError from the embedded broker) is no.
            if not for_code(code).retriable or time.monotonic() > deadline:
                log.info("the broker grants no producer id (%s)", for_code(code).__name__)
                return False
            await asyncio.sleep(0.2)
    except KafkaError as error:
        log.info("the broker grants no producer id (%r)", error)
        return False
    finally:
        await client.close()


class Publisher:
    """The worker's producer: acks="all", idempotent where the broker allows (setting `idempotence`),
    batches raised, compressed with `results_compression`.

    With a `transactional_id` it is one requests partition's transactional producer (exactly-once
    delivery): `deliver_in_transaction` writes records and the partition's consumed offset together, and
    starting it fences any earlier producer of the same id (the partition's previous owner).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        transactional_id: str | None = None,
        topics: dict[str, tuple[bool, float]] | None = None,
    ) -> None:
        self._settings = settings
        self._retry_s = settings.publish_timeout_ms / 1000
        self._producer: AIOKafkaProducer | None = None
        self.transactional_id = transactional_id
        self.idempotent: bool | None = None  # decided at start
        # reply topic -> (exists, until when that holds); shared by the producers of one worker
        self._topics: dict[str, tuple[bool, float]] = {} if topics is None else topics

    def _build(self, idempotent: bool) -> AIOKafkaProducer:
        settings = self._settings
        # max_batch_size follows the record limit so results share produce requests instead of each result
        # above the 16 KiB default travelling alone.
        return AIOKafkaProducer(
            **settings.kafka_client_kwargs(),
            acks="all",
            linger_ms=settings.publish_linger_ms,
            max_batch_size=settings.max_record_bytes,
            max_request_size=settings.max_record_bytes,
            enable_idempotence=idempotent,
            compression_type=producer_compression(settings.results_compression),
            transactional_id=self.transactional_id,
            transaction_timeout_ms=settings.transaction_timeout_ms,
        )

    def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise RuntimeError("the publisher is not started")
        return self._producer

    async def start(self, idempotent: bool | None = None) -> None:
        """Build and start the producer; `idempotent` as decided already, or None to decide by the
        `idempotence` setting (asking the brokers on auto). A transactional producer is idempotent, and
        its start registers the transactional id (aborting what an earlier producer of it left open)."""
        mode = self._settings.idempotence
        if self.transactional_id is not None:
            idempotent = True
        elif idempotent is None and mode != "auto":
            idempotent = mode == "on"
        if idempotent is None:
            idempotent = await broker_grants_producer_ids(self._settings.kafka_client_kwargs())
            log.info(
                "results producer: %s",
                "idempotent" if idempotent else "not idempotent (the broker grants no producer ids)",
            )
        self.idempotent = idempotent
        self._producer = self._build(idempotent)
        await self._producer.start()
        if self.transactional_id is not None:
            # An empty transaction waits for the producer id, which the broker grants only once it has
            # fenced the earlier producer of this id and aborted what that one left open: the caller may
            # read the partition's committed offset after this and find it final.
            await self._producer.begin_transaction()
            await self._producer.abort_transaction()

    async def stop(self) -> None:
        """Flush what is buffered, then close."""
        if self._producer is not None:
            _read_fatal_error(self._producer)
            await self._producer.stop()

    async def deliver(self, records: Sequence[OutRecord]) -> list[tuple[OutRecord, OutRecord]]:
        """Send and wait for the broker's acknowledgement of every record, retrying the failed ones.

        A result bound for a reply topic that does not exist goes to the results topic as an error result
        instead; those swaps are returned (as sent, instead of), for the caller's counts.
        Raises PublishError after the last attempt: the caller must not mark those records done.
        """
        swapped: list[tuple[OutRecord, OutRecord]] = []
        pending = await self._routed(records, swapped)
        give_up_at = time.monotonic() + self._retry_s
        attempt = 0
        while True:
            attempt += 1
            outcomes = await self._send_all(pending)
            failed = _failures(pending, outcomes)
            if not failed:
                return swapped
            # The acknowledged are not sent again; the failed are, or their smaller forms.
            retry = await self._after_failures(failed, swapped)
            pending = [record for record in retry if record is not None]
            if not pending:
                return swapped
            error = next((o for _, o in failed if _retriable(o)), None)
            if error is not None:  # else only smaller forms to send: no reason to wait
                what = f"{len(failed)} of {len(outcomes)} sends"
                await self._back_off(attempt, give_up_at, error, pending, what)

    async def deliver_in_transaction(
        self, records: Sequence[OutRecord], offsets: dict[TopicPartition, int], group_id: str
    ) -> list[tuple[OutRecord, OutRecord]]:
        """Write `records` and commit the group's `offsets` in one transaction: readers with
        read_committed see all of them once the offsets are committed, or none.

        A failed send or commit aborts the transaction, and the whole transaction is tried again (refused
        records in their smaller form) until publish_timeout_ms, then PublishError. ProducerFenced is
        raised as is: another producer of this id (the partition's new owner) has taken over, and nothing
        of this transaction is visible. Returns the reply-topic swaps as `deliver` does.
        """
        producer = self._started()
        swapped: list[tuple[OutRecord, OutRecord]] = []
        pending = await self._routed(records, swapped)
        give_up_at = time.monotonic() + self._retry_s
        attempt = 0
        while True:
            attempt += 1
            await producer.begin_transaction()
            outcomes = await self._send_all(pending)
            failed = _failures(pending, outcomes)
            error: BaseException | None = None
            if not failed:
                try:
                    await producer.send_offsets_to_transaction(offsets, group_id)
                    await producer.commit_transaction()
                    return swapped
                except ProducerFenced:
                    raise
                except KafkaError as exc:
                    error = exc
            else:
                # Within a transaction nothing is kept of an attempt that failed: all is sent again.
                retry = await self._after_failures(failed, swapped)
                fixed = {id(r): new for (r, _), new in zip(failed, retry, strict=True)}
                pending = [r for r in (fixed.get(id(r), r) for r in pending) if r is not None]
                error = next((o for _, o in failed if _retriable(o)), None)
                if isinstance(error, ProducerFenced):
                    raise error
            await self._abort(producer)
            if error is not None:
                await self._back_off(attempt, give_up_at, error, pending, "a transaction")

    @staticmethod
    async def _abort(producer: AIOKafkaProducer) -> None:
        """Abort the open transaction; fenced meanwhile: ProducerFenced."""
        txn = producer._txn_manager  # aiokafka keeps the fatal state there only
        if txn is not None and txn.is_fatal_error():
            raise ProducerFenced()
        await producer.abort_transaction()

    async def _routed(
        self, records: Sequence[OutRecord], swapped: list[tuple[OutRecord, OutRecord]]
    ) -> list[OutRecord]:
        """The records to send: a result bound for a reply topic that does not exist replaced by its error
        result on the results topic (the swap noted in `swapped`)."""
        pending: list[OutRecord] = []
        for record in records:
            instead = record.make_if_topic_missing
            if instead is not None and not await self._topic_exists(record.topic):
                swapped.append((instead(), record))
                record = instead()
            pending.append(record)
        return pending

    async def _after_failures(
        self, failed: list[tuple[OutRecord, BaseException]], swapped: list[tuple[OutRecord, OutRecord]]
    ) -> list[OutRecord | None]:
        """What to send instead of each failed record (None: nothing, it is dropped)."""
        retry: list[OutRecord | None] = []
        for record, outcome in failed:
            # A reply topic deleted since it was checked: its results go to the results topic, instead
            # of being retried until publish_timeout_ms stops the worker.
            instead = record.make_if_topic_missing
            if instead is not None and _retriable(outcome):
                self._topics.pop(record.topic, None)
                if not await self._topic_exists(record.topic):
                    swapped.append((instead(), record))
                    retry.append(instead())
                    continue
            retry.append(_smaller(record, outcome))
        return retry

    async def _back_off(
        self, attempt: int, give_up_at: float, error: BaseException, pending: list[OutRecord], what: str
    ) -> None:
        """Wait before the next attempt, or raise PublishError once publish_timeout_ms is spent."""
        if attempt == 1 or attempt % 10 == 0:  # a long outage: one line now and then, not one per try
            log.warning("%s failed (attempt %d): %r", what, attempt, error)
        if time.monotonic() >= give_up_at:
            raise PublishError(
                f"could not deliver {len(pending)} records to {pending[0].topic} within "
                f"{self._retry_s:.0f} s (publish_timeout_ms): {error!r}"
            )
        await asyncio.sleep(min(_MAX_BACKOFF_S, 0.2 * 2**attempt))

    async def _topic_exists(self, topic: str) -> bool:
        """Whether the brokers know `topic` (cached). Metadata that cannot be read (the brokers away) counts
        as yes: the send then waits and retries like any other, instead of answering an error."""
        now = time.monotonic()
        known = self._topics.get(topic)
        if known is not None and now < known[1]:
            return known[0]
        try:
            cluster = await asyncio.wait_for(
                self._started().client.fetch_all_metadata(), _TOPIC_CHECK_TIMEOUT_S
            )
        except (KafkaError, TimeoutError) as error:
            log.warning("could not read the brokers' topics to check reply topic %r: %r", topic, error)
            return True
        exists = topic in cluster.topics()
        self._topics[topic] = (exists, now + (_TOPIC_KNOWN_S if exists else _TOPIC_MISSING_S))
        if not exists:
            log.warning("reply topic %r does not exist: its results go to the results topic as errors", topic)
        return exists

    async def _send_all(self, records: list[OutRecord]) -> list[object]:
        """Enqueue in order (keeps per-partition order), then wait for all acks; exceptions are returned."""
        acks: list[asyncio.Future[object]] = []
        for record in records:
            try:
                acks.append(
                    await self._started().send(record.topic, record.value, record.key, headers=record.headers)
                )
            except Exception as exc:  # the client refusing one record must not stop the others
                failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                acks.append(failed)
        return list(await asyncio.gather(*acks, return_exceptions=True))


def _failures(records: list[OutRecord], outcomes: list[object]) -> list[tuple[OutRecord, BaseException]]:
    """The records whose send failed, with why."""
    return [(r, o) for r, o in zip(records, outcomes, strict=True) if isinstance(o, BaseException)]


def _read_fatal_error(producer: AIOKafkaProducer) -> None:
    """A producer whose sender stopped on an error (a fenced transactional producer) leaves that error on
    futures nobody awaits: aiokafka's transaction waiter and each failed batch's drain waiter. Read them,
    so that none is reported as lost when collected: the error was handled and logged where it surfaced.
    (Collected inside another thread's or a nested `ast.parse`, such a report has broken CPython 3.11's
    AST recursion bookkeeping.)"""
    txn = producer._txn_manager
    futures = [getattr(txn, "_transaction_waiter", None)]
    accumulator = getattr(producer, "_message_accumulator", None)
    queued = getattr(accumulator, "_batches", {}).values()
    batches = [*(batch for queue in queued for batch in queue), *getattr(accumulator, "_pending_batches", ())]
    futures += [getattr(batch, name, None) for batch in batches for name in ("future", "_drain_waiter")]
    for future in futures:
        if isinstance(future, asyncio.Future) and future.done() and not future.cancelled():
            future.exception()


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
    if (fallback := record.fallback()) is not None:
        log.warning("a %s record was refused (%r); sending its smallest form", record.topic, error)
        return fallback
    log.error("even the smallest %s record is refused (%r); it is dropped", record.topic, error)
    return None
