"""ScoreWorker: consume requests, batch them, score on a model thread, publish results, commit safely."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from models import ModelInfo
from worker.batcher import Batch, TokenBudgetBatcher
from worker.config import WorkerSettings
from worker.health import Readiness
from worker.intake import Accepted, Intake, Outgoing, Rejected, ScorerLike, record_size
from worker.metrics import ResultTally, WorkerMetrics
from worker.offsets import OffsetTracker
from worker.publisher import Publisher
from worker.topics import ensure_topics

log = logging.getLogger(__name__)

# Longest the fetch loop sleeps in getmany: bounds how late stop() and periodic commits are noticed.
_POLL_MS = 200
# How often the fetch loop samples lag, pauses and in-flight counts into the metrics.
_SAMPLE_S = 1.0


class _RevokeListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: ScoreWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._worker._on_assigned(assigned)


class ScoreWorker:
    """One worker of the consumer group; `run()` until `stop()`, then it publishes what it holds and commits.

    Delivery is at least once: an offset is committed only after the broker acknowledged the result (and,
    for a rejected record, its dead-letter copy). Records are never skipped silently.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        scorer: ScorerLike,
        metrics: WorkerMetrics | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self._settings = settings
        if metrics is None:
            metrics = WorkerMetrics(settings.worker_id)
            metrics.bind_model(model_info(scorer), settings.max_batch_tokens)
        self.metrics = metrics
        self.readiness = readiness or Readiness(metrics, model_loaded=True)
        self._intake = Intake(settings, scorer, metrics)
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._batcher: TokenBudgetBatcher[Accepted] = TokenBudgetBatcher(
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
        self._ready: deque[Batch[Accepted]] = deque()
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
            self.readiness.update(group_joined=False)
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
        self.readiness.update(broker_reachable=True)
        probe = asyncio.get_running_loop().create_task(self._probe_broker(), name="broker-probe")
        try:
            await self._consume()
            await self._drain()
        finally:
            probe.cancel()
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
        next_sample = time.monotonic()
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
            if time.monotonic() >= next_sample:
                await self._sample_state()
                next_sample = time.monotonic() + _SAMPLE_S

    async def _sample_state(self) -> None:
        """In-flight, paused and per-partition lag (high-water mark minus position) into the metrics."""
        assert self._consumer is not None
        self.metrics.state(self._tracker.pending(), len(self._consumer.paused()))
        lags: dict[tuple[str, int], int] = {}
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is None:  # nothing fetched from it yet: the position may not be known either
                continue
            with contextlib.suppress(KafkaError, TimeoutError):
                async with asyncio.timeout(0.05):
                    lags[(tp.topic, tp.partition)] = highwater - await self._consumer.position(tp)
        self.metrics.set_lag(lags)

    async def _probe_broker(self) -> None:
        """Readiness: ask the brokers for metadata now and then; no answer in time means not reachable."""
        assert self._consumer is not None
        interval = self._settings.broker_probe_interval_ms / 1000
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self._consumer.topics()
                reachable = True
            except (KafkaError, TimeoutError, OSError):
                reachable = False
            self.readiness.update(broker_reachable=reachable)
            await asyncio.sleep(interval)

    def _apply_backpressure(self) -> None:
        assert self._consumer is not None
        limit = self._settings.max_inflight_requests
        pending = self._tracker.pending()
        paused = self._consumer.paused()
        if pending >= limit:
            if not paused:
                log.info("pausing fetches: %d requests in flight (max_inflight_requests %d)", pending, limit)
            self._consumer.pause(*self._consumer.assignment())
        elif paused and pending <= limit // 2:
            # Resume at half the limit, not just below it, so a busy worker does not flap.
            log.info("resuming fetches: %d requests in flight", pending)
            self._consumer.resume(*paused)

    async def _accept(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        size = 0
        for record in records:
            self._tracker.track(TopicPartition(record.topic, record.partition), record.offset)
            size += record_size(record)
        self.metrics.fetched(len(records), size)
        log.debug("fetched %d records, %d in flight", len(records), self._tracker.pending())
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._prepare_thread, self._intake.prepare_all, records)
        rejected = [o for o in outcomes if isinstance(o, Rejected)]
        if rejected:
            self._spawn(self._publish_rejected(rejected))
        for outcome in outcomes:
            if isinstance(outcome, Accepted):
                for batch in self._batcher.add(outcome, outcome.prepared.num_tokens):
                    self._dispatch(batch)
        # A revocation that began while these were being prepared is waiting for them: wake it to close
        # the batch they joined (the fetch loop cannot: getmany blocks until the rebalance is over).
        self._progress.set()

    def _dispatch(self, batch: Batch[Accepted] | None) -> None:
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

    async def _run_batch(self, batch: Batch[Accepted]) -> None:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        self.metrics.batch_started(len(batch.items), batch.tokens, (now - i.ready_at for i in batch.items))
        try:
            outgoing = await loop.run_in_executor(self._model_thread, self._intake.score, batch.items)
        finally:
            self._model_done()
        await self._deliver(outgoing)
        for item in batch.items:
            self._tracker.done(item.tp, item.offset)

    async def _publish_rejected(self, rejected: list[Rejected]) -> None:
        tally = ResultTally()
        for item in rejected:
            tally.merge(item.tally)
        await self._deliver(Outgoing([message for item in rejected for message in item.messages], tally))
        for item in rejected:
            self._tracker.done(item.tp, item.offset)

    async def _deliver(self, outgoing: Outgoing) -> None:
        assert self._publisher is not None
        started = time.monotonic()
        await self._publisher.deliver(outgoing.records)
        self.metrics.published(outgoing.tally, time.monotonic() - started)

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
            self.metrics.commit_failed()
            return
        self.metrics.committed()
        self._tracker.mark_committed(offsets)

    async def _drain(self) -> None:
        """Stop fetching and wait until everything fetched is published."""
        assert self._consumer is not None
        self._consumer.pause(*self._consumer.assignment())
        await self._finish_in_flight(None, timeout_s=None, keep_polling=True)

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info(
            "assigned partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned) or "none"
        )
        self.metrics.assigned_partitions(len(assigned))
        # A member without partitions (more workers than partitions) has joined all the same.
        self.readiness.update(group_joined=True)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Before losing partitions, let their in-flight requests finish (bounded), commit, forget them."""
        self.metrics.forget_partitions((tp.topic, tp.partition) for tp in revoked)
        if not revoked:
            return
        log.info("revoking partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked))
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


def model_info(scorer: ScorerLike) -> ModelInfo:
    """The scorer's own description where it has one (models.Scorer), else its name alone."""
    info = getattr(scorer, "info", None)
    if isinstance(info, ModelInfo):
        return info
    return ModelInfo(scorer.model_name, "unknown", "unknown", "unknown", 0)
