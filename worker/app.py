"""ScoreWorker: consume requests, batch them, score on a model thread, publish results, commit safely."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from schemas import (
    ErrorCode,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_request,
    header_request_id,
)
from worker.batcher import Batch, TokenBudgetBatcher
from worker.config import WorkerSettings
from worker.offsets import OffsetTracker
from worker.publisher import OutRecord, Publisher, dead_letter_record, result_record
from worker.topics import ensure_topics

log = logging.getLogger(__name__)

# Longest the fetch loop sleeps in getmany: bounds how late stop() and periodic commits are noticed.
_POLL_MS = 200


class ScorerLike(Protocol):
    """What the worker needs of models.Scorer."""

    @property
    def model_name(self) -> str: ...

    def prepare(self, request: ScoreRequest) -> Any: ...

    def score_prepared(self, prepared: Sequence[Any]) -> list[ScoreResult]: ...


@dataclass(eq=False)
class _Accepted:
    """A decoded, tokenised request waiting for (or in) a model batch."""

    tp: TopicPartition
    offset: int
    key: bytes | None
    request: ScoreRequest
    prepared: Any


@dataclass(eq=False)
class _Rejected:
    """A record answered without a model run, with the records that answer it (result and/or DLQ copy)."""

    tp: TopicPartition
    offset: int
    messages: list[OutRecord]


class _RevokeListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: ScoreWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))


class ScoreWorker:
    """One worker of the consumer group; `run()` until `stop()`, then it publishes what it holds and commits.

    Delivery is at least once: an offset is committed only after the broker acknowledged the result (and,
    for a rejected record, its dead-letter copy). Records are never skipped silently.
    """

    def __init__(self, settings: WorkerSettings, scorer: ScorerLike) -> None:
        self._settings = settings
        self._scorer = scorer
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._batcher: TokenBudgetBatcher[_Accepted] = TokenBudgetBatcher(
            settings.max_batch_tokens, settings.max_batch_requests, settings.max_wait_ms / 1000
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False
        self._fatal: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._publisher: Publisher | None = None
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="score-model")
        # Closed batches waiting for the model thread, which takes one at a time: while it is busy, arriving
        # requests keep filling the open batch instead of being cut into small batches queued behind it.
        self._ready: deque[Batch[_Accepted]] = deque()
        self._model_busy = False
        self._closed = False  # set once run() tears down: no new batch may start after that
        # Tokenising off the loop keeps heartbeats timely; its own thread lets it overlap a forward pass.
        self._prepare_thread = ThreadPoolExecutor(1, thread_name_prefix="score-prepare")

    @property
    def in_flight(self) -> int:
        """Requests fetched but not yet fully published (what backpressure limits)."""
        return self._tracker.pending()

    def stop(self) -> None:
        """Ask the worker to stop fetching, publish what it holds, commit and return (thread/signal safe)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stop_requested = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._request_stop()
        else:
            loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        if not self._stop_requested:
            log.info("stop requested: %d fetched requests in flight, finishing them", self._tracker.pending())
        self._stop_requested = True

    async def run(self) -> None:
        """Consume until stop(); raises PublishError if results cannot be delivered."""
        self._loop = asyncio.get_running_loop()
        try:
            if self._settings.create_topics:
                await ensure_topics(self._settings)
            self._publisher = Publisher(self._settings)
            await self._publisher.start()
            try:
                await self._run_consumer()
            finally:
                await self._publisher.stop()
        finally:
            self._closed = True
            for task in list(self._tasks):  # only left after an error: their offsets stay uncommitted
                task.cancel()
            self._model_thread.shutdown(wait=False, cancel_futures=True)
            self._prepare_thread.shutdown(wait=False, cancel_futures=True)
        if self._fatal is not None:
            raise self._fatal
        log.info("worker stopped")

    async def _run_consumer(self) -> None:
        self._consumer = self._make_consumer()
        self._consumer.subscribe([self._settings.requests_topic], listener=_RevokeListener(self))
        await self._consumer.start()
        try:
            await self._consume()
            await self._drain()
        finally:
            # Commits only offsets whose records were fully published: safe after an error too.
            await self._commit()
            await self._consumer.stop()

    def _make_consumer(self) -> AIOKafkaConsumer:
        settings = self._settings
        return AIOKafkaConsumer(
            **settings.kafka_client_kwargs(),
            group_id=settings.group_id,
            enable_auto_commit=False,
            auto_offset_reset=settings.auto_offset_reset,
            session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=settings.heartbeat_interval_ms,
            max_poll_interval_ms=settings.max_poll_interval_ms,
            fetch_max_wait_ms=settings.fetch_max_wait_ms,
            # How long the group waits for members to rejoin: a revocation finishing in-flight work needs
            # up to half of it (aiokafka's default, the session timeout, would evict this worker mid-wait).
            rebalance_timeout_ms=settings.max_poll_interval_ms,
        )

    async def _consume(self) -> None:
        assert self._consumer is not None
        next_commit = time.monotonic() + self._settings.commit_interval_ms / 1000
        while not self._stop_requested and self._fatal is None:
            self._apply_backpressure()
            room = max(1, self._settings.max_inflight_requests - self._tracker.pending())
            due = None if self._model_busy else self._batcher.due_in()
            timeout_ms = _POLL_MS if due is None else min(_POLL_MS, int(due * 1000))
            # Called even while paused: polling is what keeps this consumer in the group.
            fetched = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=room)
            records = [record for batch in fetched.values() for record in batch]
            if records:
                await self._accept(records)
            if not self._model_busy:  # a busy model thread closes the open batch itself when it is done
                self._dispatch(self._batcher.take_due())
            if time.monotonic() >= next_commit:
                await self._commit()
                next_commit = time.monotonic() + self._settings.commit_interval_ms / 1000

    def _apply_backpressure(self) -> None:
        assert self._consumer is not None
        limit = self._settings.max_inflight_requests
        pending = self._tracker.pending()
        paused = self._consumer.paused()
        if pending >= limit:
            self._consumer.pause(*self._consumer.assignment())
        elif paused and pending <= limit // 2:
            # Resume at half the limit, not just below it, so a busy worker does not flap.
            self._consumer.resume(*paused)

    async def _accept(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        for record in records:
            self._tracker.track(TopicPartition(record.topic, record.partition), record.offset)
        log.debug("fetched %d records, %d in flight", len(records), self._tracker.pending())
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._prepare_thread, self._prepare_all, records)
        rejected = [o for o in outcomes if isinstance(o, _Rejected)]
        if rejected:
            self._spawn(self._publish_rejected(rejected))
        for outcome in outcomes:
            if isinstance(outcome, _Accepted):
                for batch in self._batcher.add(outcome, outcome.prepared.num_tokens):
                    self._dispatch(batch)
        # A revocation that began while these were being prepared is waiting for them: wake it to close
        # the batch they joined (the fetch loop cannot: getmany blocks until the rebalance is over).
        self._progress.set()

    def _prepare_all(self, records: list[ConsumerRecord[bytes, bytes]]) -> list[_Accepted | _Rejected]:
        return [self._prepare_one(record) for record in records]

    def _prepare_one(self, record: ConsumerRecord[bytes, bytes]) -> _Accepted | _Rejected:
        tp = TopicPartition(record.topic, record.partition)
        try:
            request = decode_request(record.value if record.value is not None else b"")
        except SchemaError as error:
            return self._reject_record(record, error.code, error.message, error.request_id)
        except Exception as exc:  # decode_request promises SchemaError only; never lose a record to a bug
            log.exception("decoding offset %d of %s failed unexpectedly", record.offset, tp)
            return self._reject_record(record, ErrorCode.INTERNAL_ERROR, f"decoding failed: {exc!r}", None)
        try:
            prepared = self._scorer.prepare(request)
        except Exception as exc:
            log.exception("preparing request %s failed unexpectedly", request.request_id)
            prepared = self._failure(
                request, ErrorCode.INTERNAL_ERROR, f"preparing the request failed: {exc!r}"
            )
        if isinstance(prepared, ScoreResult):
            # Well-formed but unscorable (empty input, too long, ...): the result tells the producer why.
            return _Rejected(tp, record.offset, [result_record(self._settings, record.key, prepared)])
        return _Accepted(tp, record.offset, record.key, request, prepared)

    def _reject_record(
        self, record: ConsumerRecord[bytes, bytes], code: ErrorCode, message: str, request_id: str | None
    ) -> _Rejected:
        """A record that breaks the wire contract: error result if its id is known, always a DLQ copy."""
        tp = TopicPartition(record.topic, record.partition)
        log.warning(
            "rejected offset %d of %s[%d]: %s %s", record.offset, tp.topic, tp.partition, code, message
        )
        messages = [dead_letter_record(self._settings, record, code, message)]
        request_id = request_id or header_request_id(record.headers)
        if request_id:
            try:
                failure = ScoreResult.failure(request_id, code, message, model=self._scorer.model_name)
            except SchemaError:
                # The header's id is no valid request id (too long, ...): the dead-letter copy is the trace.
                log.warning("offset %d of %s: header request id is not usable", record.offset, tp)
            else:
                messages.insert(0, result_record(self._settings, record.key, failure))
        return _Rejected(tp, record.offset, messages)

    def _failure(self, request: ScoreRequest, code: ErrorCode, message: str) -> ScoreResult:
        return ScoreResult.failure(
            request.request_id, code, message, model=self._scorer.model_name, metadata=request.metadata
        )

    def _dispatch(self, batch: Batch[_Accepted] | None) -> None:
        """Queue a closed batch for the model thread and start the next batch if the thread is free."""
        if batch is not None:
            self._ready.append(batch)
        if not self._model_busy and self._ready:
            self._model_busy = True
            self._spawn(self._run_batch(self._ready.popleft()))

    def _model_done(self) -> None:
        """The model thread is free: give it the next full batch, or else what gathered while it was busy.

        Those requests have already waited a whole forward pass, so the open batch closes now rather than
        after max_wait; under load this keeps batches as large as the arrival rate allows.
        """
        self._model_busy = False
        if not self._closed:
            self._dispatch(None if self._ready else self._batcher.flush())

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # The first failure stops the worker; later ones are logged too, not swallowed.
            log.error("stopping: %s", error, exc_info=error)
            self._fatal = self._fatal or error
        self._progress.set()

    async def _run_batch(self, batch: Batch[_Accepted]) -> None:
        loop = asyncio.get_running_loop()
        try:
            messages = await loop.run_in_executor(self._model_thread, self._score_batch, batch.items)
        finally:
            self._model_done()
        await self._deliver_records(messages)
        for item in batch.items:
            self._tracker.done(item.tp, item.offset)

    def _score_batch(self, items: Sequence[_Accepted]) -> list[OutRecord]:
        """Runs on the model thread: score, then encode (encoding large hidden states is not free)."""
        try:
            results = self._scorer.score_prepared([item.prepared for item in items])
            if len(results) != len(items):
                raise RuntimeError(f"scorer returned {len(results)} results for {len(items)} requests")
        except Exception as exc:  # the Scorer reports model failures itself; this is a last resort
            log.exception("scoring a batch of %d requests failed", len(items))
            results = [
                self._failure(i.request, ErrorCode.INTERNAL_ERROR, f"scoring failed: {exc!r}") for i in items
            ]
        return [result_record(self._settings, i.key, r) for i, r in zip(items, results, strict=True)]

    async def _publish_rejected(self, rejected: list[_Rejected]) -> None:
        await self._deliver_records([message for item in rejected for message in item.messages])
        for item in rejected:
            self._tracker.done(item.tp, item.offset)

    async def _deliver_records(self, records: list[OutRecord]) -> None:
        assert self._publisher is not None
        await self._publisher.deliver(records)

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        offsets = self._tracker.to_commit(partitions)
        if not offsets or self._consumer is None:
            return
        try:
            # aiokafka retries a commit until the coordinator answers, forever while the broker is away;
            # past the session timeout the group has moved on anyway, and a stop must not hang on it.
            async with asyncio.timeout(self._settings.session_timeout_ms / 1000):
                await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError, TimeoutError) as exc:
            # Lost the partitions in a rebalance (or the broker is away): the next owner re-reads from the
            # last commit, so this means duplicates, never loss.
            log.warning("commit of %d partitions failed: %r", len(offsets), exc)
            return
        self._tracker.mark_committed(offsets)

    async def _drain(self) -> None:
        """Stop fetching and wait until everything fetched is published."""
        assert self._consumer is not None
        self._consumer.pause(*self._consumer.assignment())
        await self._finish_in_flight(None, timeout_s=None, keep_polling=True)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Before losing partitions, let their in-flight requests finish (bounded), commit, forget them."""
        if not revoked:
            return
        limit_s = min(self._settings.max_poll_interval_ms / 2000, 30.0)
        if not await self._finish_in_flight(revoked, timeout_s=limit_s, keep_polling=False):
            log.warning("%d requests still in flight at revocation", self._tracker.pending(revoked))
        await self._commit(revoked)
        self._tracker.drop(revoked)

    async def _finish_in_flight(
        self, partitions: set[TopicPartition] | None, timeout_s: float | None, keep_polling: bool
    ) -> bool:
        """Wait until the fetched requests of `partitions` (all when None) are published; False on timeout.

        The open batch is closed on every wake-up, not once: requests that were still being prepared join
        it later. `keep_polling` calls getmany (nothing comes back: all paused) so that a long drain does
        not exceed max_poll_interval; a revocation must not, as getmany waits for the rebalance to end.
        """
        assert self._consumer is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._tracker.pending(partitions) and self._fatal is None:
            if not self._model_busy:  # else the model thread closes the open batch when it is done
                self._dispatch(self._batcher.flush())
            remaining = _POLL_MS / 1000 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout=min(remaining, _POLL_MS / 1000))
            if keep_polling:
                await self._consumer.getmany(timeout_ms=0)
        return True
