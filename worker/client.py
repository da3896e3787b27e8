"""Producer-side client: send score requests to Kafka and collect each one's result by its request id."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas import (
    HEADER_REPLY_TOPIC,
    REQUESTS_TOPIC,
    RESULTS_TOPIC,
    Compare,
    Input,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_result,
    encode_request,
    header_request_id,
    request_headers,
)
from worker.codecs import DEFAULT_COMPRESSION, Compression, producer_compression
from worker.errors import WorkerError
from worker.topics import create_missing_topics, topic_partitions
from worker.undecodable import FetchGuard, Unreadable, classify, describe, read_raw_batch

log = logging.getLogger(__name__)

DEFAULT_REQUESTS_TOPIC = REQUESTS_TOPIC
DEFAULT_RESULTS_TOPIC = RESULTS_TOPIC
# The broker's default message.max.bytes; producer, topic and broker limits must agree.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024


class ScoreClientError(WorkerError):
    """The client could not start, send, or read results."""


class ResultsTimeoutError(ScoreClientError, TimeoutError):
    """Some results did not arrive in time; `missing` names their request ids."""

    def __init__(self, missing: Sequence[str], total: int, timeout: float) -> None:
        self.missing = tuple(missing)
        self.total = total
        self.timeout = timeout
        shown = ", ".join(self.missing[:5]) + (", ..." if len(self.missing) > 5 else "")
        super().__init__(
            f"timed out after {timeout:g} s: {len(self.missing)} of {total} results missing "
            f"(request ids: {shown}); is a worker consuming the requests topic?"
        )


class ResultDecodeError(ScoreClientError):
    """A result addressed to one of this client's requests could not be decoded."""


@dataclass
class ClientStats:
    """Counters of what the results consumer saw; useful to check delivery in tests and tools."""

    sent: int = 0
    received: int = 0
    duplicates: int = 0  # a second result for an id already answered (at-least-once redelivery)
    unknown: int = 0  # results for ids this client is not waiting for (other producers, late results)
    undecodable: int = 0
    # Offsets of the results topic skipped because their batch could not be read at all (a damaged batch):
    # the results there are lost to this client, and their requests time out, named.
    unreadable: int = 0


def new_request_id() -> str:
    """A fresh, globally unique request id."""
    return uuid.uuid4().hex


class ScoreClient:
    """Sends `ScoreRequest`s and resolves one future per request when its `ScoreResult` arrives.

    Results are read by manual assignment of every partition of the results topic (no consumer group, so
    no join delay and no committed offsets), positioned at the log end before the first request is sent:
    no result of ours can be missed, and results that were already there are never replayed.

    With `reply_topic`, every request names that topic for its result (the `kafka_replyTopic` header) and
    the client reads it instead of the shared results topic: it then sees its own results only. The topic
    is created (with `reply_topic_partitions` partitions) when missing, and must match the workers'
    `reply_topic_pattern` (by default a name under the results topic's, e.g. `score.results.my-app`).
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        *,
        requests_topic: str = DEFAULT_REQUESTS_TOPIC,
        results_topic: str = DEFAULT_RESULTS_TOPIC,
        client_id: str = "score-client",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        start_timeout: float = 30.0,
        remembered_ids: int = 100_000,
        kafka_options: Mapping[str, Any] | None = None,
        reply_topic: str | None = None,
        reply_topic_partitions: int = 1,
        compression: Compression = DEFAULT_COMPRESSION,
        read_committed: bool = True,
        fetch_max_wait_ms: int = 50,
        linger_ms: int = 2,
    ) -> None:
        """`kafka_options` go to every aiokafka client (e.g. security_protocol, ssl_context, sasl_*);
        `compression` is the codec of the request batches it sends (results of any codec are read).

        `fetch_max_wait_ms`: longest the broker may hold the results reader's fetch. Apache Kafka answers
        a waiting fetch as soon as a result arrives, so the wait costs nothing there; the embedded broker
        looks again only part-way through it, so there a result waits about a quarter of it (set 2-5 for
        one request at a time, at the price of that many more idle fetches). `linger_ms`: how long the
        producer holds requests to send more of them together (0 for one request at a time).

        Results are read with isolation.level=read_committed: against workers delivering exactly once
        it sees only results whose transactions committed (each once); against at-least-once workers,
        which write no transactions, it sees the same as read_uncommitted at no cost."""
        self.requests_topic = requests_topic
        self.results_topic = results_topic
        self.reply_topic = reply_topic
        self._reply_partitions = reply_topic_partitions
        self.stats = ClientStats()
        self._bootstrap = bootstrap_servers
        self._client_id = client_id
        self._max_message_bytes = max_message_bytes
        self._start_timeout = start_timeout
        self._remembered_ids = remembered_ids
        self._kafka_options = dict(kafka_options or {})
        self._compression = compression
        self._isolation = "read_committed" if read_committed else "read_uncommitted"
        if fetch_max_wait_ms < 0 or linger_ms < 0:
            waits = f"{fetch_max_wait_ms}, {linger_ms}"
            raise ValueError(f"fetch_max_wait_ms and linger_ms must be >= 0, got {waits}")
        self._fetch_max_wait_ms, self._linger_ms = fetch_max_wait_ms, linger_ms
        self._pending: dict[str, asyncio.Future[ScoreResult]] = {}
        # Answered ids, bounded: tells a redelivered duplicate from a stranger's result.
        self._answered: OrderedDict[str, None] = OrderedDict()
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._guard: FetchGuard | None = None
        self._retried: set[tuple[TopicPartition, int]] = set()  # unreadable offsets read once more
        self._reader: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    async def __aenter__(self) -> ScoreClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, position the results consumer at the end of every partition, then start the producer."""
        if self._reader is not None:
            raise ScoreClientError("client already started")
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            client_id=f"{self._client_id}-results",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="latest",
            fetch_max_wait_ms=self._fetch_max_wait_ms,
            max_partition_fetch_bytes=self._max_message_bytes,
            isolation_level=self._isolation,
            **self._kafka_options,
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap,
            client_id=self._client_id,
            acks="all",
            linger_ms=self._linger_ms,
            max_batch_size=256 * 1024,
            max_request_size=self._max_message_bytes,
            compression_type=producer_compression(self._compression),
            **self._kafka_options,
        )
        try:
            await asyncio.wait_for(self._connect(), self._start_timeout)
        except TimeoutError:
            await self._close_clients()
            raise ScoreClientError(
                f"could not connect to Kafka at {self._bootstrap} within {self._start_timeout:g} s"
            ) from None
        except BaseException:
            await self._close_clients()
            raise
        self._reader = asyncio.create_task(self._read_results(), name="score-client-results")

    async def stop(self) -> None:
        """Stop reading and sending; futures still waiting are cancelled."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        await self._close_clients()

    async def submit(self, request: ScoreRequest) -> asyncio.Future[ScoreResult]:
        """Send one request and wait for the broker's acknowledgement; the future resolves to its result."""
        future = self._register(request)
        try:
            delivery = await self._send(request)
            await delivery
        except BaseException:
            self._forget(request.request_id, future)
            raise
        return future

    async def score(
        self,
        requests: Iterable[ScoreRequest],
        timeout: float | None = 60.0,  # noqa: ASYNC109 - one budget for sending and collecting
    ) -> list[ScoreResult]:
        """Send all requests and return their results in the same order.

        Raises `ResultsTimeoutError` when not every result arrived within `timeout` seconds (counted from
        the call, sending included).
        """
        batch = list(requests)
        by_id = {result.request_id: result async for result in self.stream(batch, timeout=timeout)}
        return [by_id[request.request_id] for request in batch]

    async def compare(
        self,
        items: Sequence[Input],
        query: Input | None = None,
        *,
        rank: bool = False,
        reward_column: int | None = None,
        timeout: float | None = 60.0,  # noqa: ASYNC109 - one budget for sending and collecting
        **fields: Any,
    ) -> ScoreResult:
        """Score `items`, responses to one prompt, and compare them: `compare` "pairwise" for two items
        (the result's `preference`), "rank" for more or with `rank` (its `ranking` and
        `best_probability`); `fields`: other request fields (messages, label_token_ids, ...). The request
        requires its comparison fields, so a worker older than them refuses it instead of scoring alone."""
        kind = Compare.PAIRWISE if len(items) == 2 and not rank else Compare.RANK
        required = ("compare",) if reward_column is None else ("compare", "reward_column")
        request = ScoreRequest(
            fields.pop("request_id", None) or new_request_id(), items=tuple(items), query=query,
            compare=kind, reward_column=reward_column, requires=required, **fields,
        )  # fmt: skip
        (result,) = await self.score([request], timeout=timeout)
        return result

    async def stream(
        self,
        requests: Iterable[ScoreRequest],
        timeout: float | None = 60.0,  # noqa: ASYNC109 - one budget for sending and collecting
    ) -> AsyncIterator[ScoreResult]:
        """Send all requests, then yield their results in arrival order.

        Raises `ResultsTimeoutError` once `timeout` seconds have passed with results still missing.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        batch = list(requests)
        _check_unique_ids(batch)
        futures: dict[asyncio.Future[ScoreResult], str] = {}
        # Each future announces itself when done: waiting on a queue stays linear in the batch size, where
        # asyncio.wait over the still-missing futures would re-register all of them for every arrival.
        arrivals: asyncio.Queue[asyncio.Future[ScoreResult]] = asyncio.Queue()
        try:
            await self._send_batch(batch, futures, arrivals, deadline, timeout)
            for _ in batch:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    arrived = await asyncio.wait_for(arrivals.get(), remaining)
                except TimeoutError:
                    missing = [request_id for future, request_id in futures.items() if not future.done()]
                    raise ResultsTimeoutError(missing, len(batch), timeout or 0.0) from None
                if arrived.cancelled():
                    raise ScoreClientError("the client was stopped while results were still missing")
                yield arrived.result()
        finally:
            for future, request_id in futures.items():
                self._forget(request_id, future)

    # -- internals --------------------------------------------------------------------------------------

    async def _send_batch(
        self,
        batch: Sequence[ScoreRequest],
        futures: dict[asyncio.Future[ScoreResult], str],
        arrivals: asyncio.Queue[asyncio.Future[ScoreResult]],
        deadline: float | None,
        budget_s: float | None,
    ) -> None:
        """Register and send every request, then wait for the broker to acknowledge them all."""
        deliveries = []
        try:
            async with asyncio.timeout_at(deadline):
                for request in batch:
                    future = self._register(request)
                    futures[future] = request.request_id
                    future.add_done_callback(arrivals.put_nowait)
                    deliveries.append(await self._send(request))
                await asyncio.gather(*deliveries)
        except TimeoutError:
            missing = [request.request_id for request in batch]
            raise ResultsTimeoutError(missing, len(batch), budget_s or 0.0) from None

    @property
    def read_topic(self) -> str:
        """Where this client's results come: its reply topic, else the shared results topic."""
        return self.reply_topic or self.results_topic

    async def _connect(self) -> None:
        assert self._consumer is not None and self._producer is not None
        if self.reply_topic is not None:
            await self._create_reply_topic()
        await self._consumer.start()
        self._guard = FetchGuard(self._consumer)
        self._guard.attach()
        await self._position_at_end(self._consumer)
        await self._producer.start()

    async def _create_reply_topic(self) -> None:
        """The reply topic, created when missing (a client owns its reply topic; workers never create it)."""
        assert self.reply_topic is not None
        options = {"bootstrap_servers": self._bootstrap, "client_id": f"{self._client_id}-admin"}
        try:
            await create_missing_topics(
                {**options, **self._kafka_options}, [self.reply_topic], self._reply_partitions, 1
            )
        except WorkerError as error:
            raise ScoreClientError(f"reply topic {self.reply_topic!r}: {error}") from error

    async def _position_at_end(self, consumer: AIOKafkaConsumer) -> None:
        partitions = await self._results_partitions(consumer)
        tps = [TopicPartition(self.read_topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        # ListOffsets "latest" is only a lower bound on some brokers (Tansu answers the base offset of the
        # last batch plus one), so seek_to_end alone could replay old results. The high watermark in a
        # fetch response is exact everywhere: fetch once from the lower bound, then seek to it.
        await consumer.seek_to_end(*tps)
        while any(consumer.highwater(tp) is None for tp in tps):
            await consumer.getmany(*tps, timeout_ms=100)  # anything returned here predates us: dropped
        assert self._guard is not None
        await self._guard.take()  # what came before the end is not ours, readable or not
        for tp in tps:
            highwater = consumer.highwater(tp)
            assert highwater is not None
            consumer.seek(tp, highwater)
        consumer.resume(*tps)

    async def _results_partitions(self, consumer: AIOKafkaConsumer) -> set[int]:
        for _ in range(20):
            partitions = await topic_partitions(consumer, self.read_topic)
            if partitions:
                return partitions
            await asyncio.sleep(0.1)
        raise ScoreClientError(
            f"results topic {self.read_topic!r} does not exist on {self._bootstrap}; "
            "start a worker first (it creates missing topics) or create the topics yourself"
        )

    def _register(self, request: ScoreRequest) -> asyncio.Future[ScoreResult]:
        if self._reader is None:
            raise ScoreClientError("client not started: use `async with ScoreClient(...)` or await start()")
        if self._failure is not None:
            raise ScoreClientError(f"results consumer failed: {self._failure!r}") from self._failure
        if request.request_id in self._pending:
            raise ValueError(f"request id {request.request_id!r} is already waiting for a result")
        self._answered.pop(request.request_id, None)
        future: asyncio.Future[ScoreResult] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        return future

    def _forget(self, request_id: str, future: asyncio.Future[ScoreResult]) -> None:
        if self._pending.get(request_id) is future:
            del self._pending[request_id]
        future.cancel()

    async def _send(self, request: ScoreRequest) -> asyncio.Future[Any]:
        assert self._producer is not None
        headers = request_headers(request.request_id)
        if self.reply_topic is not None:
            headers.append((HEADER_REPLY_TOPIC, self.reply_topic.encode()))
        delivery: asyncio.Future[Any] = await self._producer.send(
            self.requests_topic,
            value=encode_request(request),
            key=request.request_id.encode(),
            headers=headers,
        )
        self.stats.sent += 1
        return delivery

    async def _read_results(self) -> None:
        assert self._consumer is not None
        try:
            while True:
                batches = await self._consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for record in records:
                        self._handle(record)
                assert self._guard is not None
                for unreadable in await self._guard.take():
                    await self._pass_unreadable(unreadable)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead reader must not leave callers waiting for their timeout
            log.exception("results consumer failed")
            self._failure = exc
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ScoreClientError(f"results consumer failed: {exc!r}"))
            self._pending.clear()

    async def _pass_unreadable(self, unreadable: Unreadable) -> None:
        """A results batch that cannot be read: read once more when its bytes are sound (the fetch failed),
        else skipped with a warning. Reading goes on after it either way."""
        assert self._consumer is not None
        tp, offset = unreadable.tp, unreadable.offset
        batch = await read_raw_batch(self._consumer, tp, offset)
        cause = classify(unreadable, batch)
        if cause == "fetch_error" and (tp, offset) not in self._retried:
            self._retried.add((tp, offset))
        else:
            last = batch.last_offset if batch is not None and batch.base_offset <= offset else offset
            log.warning(
                "results %s[%d] offsets %d-%d cannot be read (%s): %s; skipped, their requests time out",
                tp.topic, tp.partition, offset, last, cause, describe(cause, batch, unreadable.error),
            )  # fmt: skip
            self.stats.unreadable += last - offset + 1
            offset = last + 1
        self._consumer.seek(tp, offset)
        self._consumer.resume(tp)

    def _handle(self, record: ConsumerRecord[Any, Any]) -> None:
        header_id = header_request_id(record.headers)
        if header_id is not None and header_id not in self._pending:
            self._count_unexpected(header_id)  # not ours: skip without decoding
            return
        try:
            result = decode_result(bytes(record.value or b""))
        except SchemaError as exc:
            self._fail_undecodable(exc.request_id or header_id, exc)
            return
        future = self._pending.pop(result.request_id, None)
        if future is None:
            self._count_unexpected(result.request_id)
            return
        self._remember(result.request_id)
        self.stats.received += 1
        if not future.done():
            future.set_result(result)

    def _fail_undecodable(self, request_id: str | None, exc: SchemaError) -> None:
        future = self._pending.pop(request_id, None) if request_id is not None else None
        if future is None:
            self.stats.undecodable += 1
            log.warning("ignoring an undecodable result (%s): %s", exc.code.value, exc.message)
            return
        self._remember(request_id or "")
        if not future.done():
            future.set_exception(
                ResultDecodeError(
                    f"result for request {request_id!r} is invalid: {exc.code.value}: {exc.message}"
                )
            )

    def _count_unexpected(self, request_id: str) -> None:
        if request_id in self._answered:
            self.stats.duplicates += 1
        else:
            self.stats.unknown += 1

    def _remember(self, request_id: str) -> None:
        self._answered[request_id] = None
        if len(self._answered) > self._remembered_ids:
            self._answered.popitem(last=False)

    async def _close_clients(self) -> None:
        for client in (self._producer, self._consumer):
            if client is not None:
                try:
                    await client.stop()
                except Exception:  # closing is best effort; the original error matters more
                    log.debug("error while closing a Kafka client", exc_info=True)
        self._producer = self._consumer = None


def score_sync(
    bootstrap_servers: str | Sequence[str],
    requests: Iterable[ScoreRequest],
    timeout: float | None = 60.0,
    **client_options: Any,
) -> list[ScoreResult]:
    """Blocking convenience: connect, score `requests`, disconnect. Not for use inside a running loop."""

    async def run() -> list[ScoreResult]:
        async with ScoreClient(bootstrap_servers, **client_options) as client:
            return await client.score(requests, timeout=timeout)

    return asyncio.run(run())


def _check_unique_ids(requests: Sequence[ScoreRequest]) -> None:
    seen: set[str] = set()
    for request in requests:
        if request.request_id in seen:
            raise ValueError(f"request id {request.request_id!r} appears more than once")
        seen.add(request.request_id)
