"""The source: the consumer group member that fetches requests, pauses under load, holds a partition it
cannot read at that offset (worker.holds) and reports its state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import ConsumerStoppedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.codecs import missing_codecs
from worker.config import WorkerSettings
from worker.health import Readiness
from worker.holds import PartitionHolds, Skip
from worker.logs import PAUSING, RESUMING
from worker.metrics import WorkerMetrics
from worker.undecodable import FetchGuard

log = logging.getLogger(__name__)

OnRevoked = Callable[[set[TopicPartition]], Awaitable[None]]
OnAssigned = Callable[[set[TopicPartition]], Awaitable[None]]
# A fetch that raised is tried again after this long, doubling up to the second figure.
_FETCH_RETRY_S, _FETCH_RETRY_MAX_S = 0.1, 1.0
# While fetches keep failing, one log line this often.
_FETCH_FAILURE_LOG_S = 60.0


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, source: Source) -> None:
        self._source = source

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._source.revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._source.assigned(assigned)
        await self._source.opened(assigned)


class Source:
    """One member of the consumer group. `fetch` must be called regularly even while paused: polling is
    what keeps the member in the group. Before partitions are taken away, `on_revoked` lets the owner
    finish and commit their in-flight requests. A partition whose records cannot be read stops there
    (`on_skip` publishes a range skipped past, when the settings ask for skipping); a fetch that raises is
    retried, never raised."""

    def __init__(
        self,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        readiness: Readiness,
        on_revoked: OnRevoked,
        on_skip: Skip,
        on_assigned: OnAssigned | None = None,
    ) -> None:
        self._settings = settings
        self._on_assigned = on_assigned
        self._metrics = metrics
        self._readiness = readiness
        self._on_revoked = on_revoked
        self.consumer = AIOKafkaConsumer(
            **settings.kafka_client_kwargs(),
            group_id=settings.group_id,
            group_instance_id=settings.group_instance_id,
            enable_auto_commit=False,
            auto_offset_reset=settings.auto_offset_reset,
            session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=settings.heartbeat_interval_ms,
            max_poll_interval_ms=settings.max_poll_interval_ms,
            fetch_max_wait_ms=settings.fetch_max_wait_ms,
            # Exactly-once answers only requests whose producers committed them, as its readers see.
            isolation_level="read_committed" if settings.exactly_once else "read_uncommitted",
            # How long the group waits for members to rejoin: a revocation finishing in-flight work needs
            # up to its bound (aiokafka's default, the session timeout, would evict this worker mid-wait).
            rebalance_timeout_ms=max(settings.max_poll_interval_ms, 2 * settings.revocation_timeout_ms),
        )
        self._guard = FetchGuard(self.consumer)
        self._holds = PartitionHolds(
            self.consumer, self._guard, metrics, readiness, self._seek,
            settings.undecodable_skip_after_ms / 1000, on_skip,
        )  # fmt: skip
        self._load_paused = False
        self._stopping = False  # stop_fetching was called: nothing is resumed any more
        # One past the last offset handed out, per partition: where a fetch that raised rewinds to.
        self._handed_out: dict[TopicPartition, int] = {}
        self._fetch_failures = 0
        self._fetch_failure_logged = 0.0
        self._fenced: set[TopicPartition] = set()  # paused until given again (exactly-once)
        self.generation = 0  # assignments seen: tells whether the group has moved on since

    async def start(self) -> None:
        missing = missing_codecs()
        if missing:
            log.warning(
                "this installation cannot decompress %s: a partition reaching a batch compressed so stops "
                "there (install score-worker with its declared dependencies)", ", ".join(missing),
            )  # fmt: skip
        self.consumer.subscribe([self._settings.requests_topic], listener=_Listener(self))
        await self.consumer.start()
        self._guard.attach()
        self._readiness.update(broker_reachable=True)

    async def stop(self) -> None:
        """Leave the group (a static member stays until its session times out) and close."""
        await self.consumer.stop()

    async def fetch(self, timeout_ms: int, max_records: int) -> list[ConsumerRecord[bytes, bytes]]:
        """Records fetched within `timeout_ms` (none after a fetch that raised: it is retried later)."""
        try:
            fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except ConsumerStoppedError:
            raise
        except Exception as error:  # never the end of the worker: nothing past what was handed out is lost
            await self._fetch_failed(error)
            return []
        if self._fetch_failures:
            log.warning("fetching works again after %d failed fetches", self._fetch_failures)
            self._fetch_failures = 0
            self._readiness.update(fetching=True)
        for tp, batch in fetched.items():
            self._handed_out[tp] = batch[-1].offset + 1
        await self._holds.after_fetch(fetched)
        if not self._stopping:
            await self._holds.tick(self._load_paused)
        return [record for batch in fetched.values() for record in batch]

    async def _fetch_failed(self, error: Exception) -> None:
        """Rewind every partition to what was handed out (the library may have moved past records it did
        not return), count, log now and then, wait a little."""
        self._fetch_failures += 1
        self._metrics.partitions.fetch_failed()
        self._readiness.update(fetching=False)
        now = time.monotonic()
        if self._fetch_failures == 1 or now - self._fetch_failure_logged >= _FETCH_FAILURE_LOG_S:
            self._fetch_failure_logged = now
            log.warning("fetching failed (%d in a row; retrying): %r", self._fetch_failures, error)
        await self._rewind(self.consumer.assignment() - self._holds.blocked)
        await asyncio.sleep(min(_FETCH_RETRY_MAX_S, _FETCH_RETRY_S * 2 ** min(self._fetch_failures - 1, 8)))

    async def _rewind(self, partitions: set[TopicPartition]) -> None:
        """Back to one past the last record handed out; a partition nothing was handed out of yet goes back
        to where its reading began: the group's commit, or its start when there is none (earliest)."""
        fresh = [tp for tp in partitions if tp not in self._handed_out]
        for tp in partitions - set(fresh):
            self.consumer.seek(tp, self._handed_out[tp])
        try:
            async with asyncio.timeout(self._settings.commit_timeout_ms / 1000):
                for tp in fresh:
                    committed = await self.consumer.committed(tp)
                    if committed is not None:
                        self.consumer.seek(tp, committed)
                    elif self._settings.auto_offset_reset == "earliest":
                        await self.consumer.seek_to_beginning(tp)
        except (KafkaError, TimeoutError) as error:  # the brokers away: the next failure tries again
            log.warning("could not rewind %d partitions to their commits: %r", len(fresh), error)

    def _seek(self, tp: TopicPartition, offset: int) -> None:
        """Move a partition's position; where a later rewind goes too."""
        self.consumer.seek(tp, offset)
        self._handed_out[tp] = offset

    def fully_paused(self) -> bool:
        """Every assigned partition is paused (and there is at least one)."""
        assignment = self.consumer.assignment()
        return bool(assignment) and self.consumer.paused() >= assignment

    def pause_all(self) -> None:
        self.consumer.pause(*self.consumer.assignment())

    def stop_fetching(self) -> None:
        """Pause every partition for good: the worker is draining (fetch still keeps it in the group)."""
        self._stopping = True
        self.pause_all()

    def apply_backpressure(self, in_flight: int) -> None:
        """Pause fetching at max_inflight_requests, resume at half of it (so a busy worker does not flap).
        Held partitions stay paused either way."""
        limit = self._settings.max_inflight_requests
        if in_flight >= limit:
            if not self._load_paused:
                log.info(PAUSING, in_flight, limit)
                self._load_paused = True
            self.pause_all()  # every time: a rebalance hands partitions back unpaused
        elif self._load_paused and in_flight <= limit // 2 and not self._stopping:
            log.info(RESUMING, in_flight)
            self._load_paused = False
            paused = self.consumer.paused() - self._holds.blocked - self._fenced
            if paused:
                self.consumer.resume(*paused)

    async def sample_state(self, in_flight: int) -> None:
        """In-flight, paused and per-partition lag (high-water mark minus position) into the metrics."""
        consumer = self.consumer
        self._metrics.partitions.state(in_flight, len(consumer.paused() - self._holds.blocked))
        lags: dict[tuple[str, int], int] = {}
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is None:  # nothing fetched from it yet: the position may not be known either
                continue
            with contextlib.suppress(KafkaError, TimeoutError):
                async with asyncio.timeout(0.05):
                    lags[(tp.topic, tp.partition)] = highwater - await consumer.position(tp)
        self._metrics.partitions.set_lag(lags)

    async def probe_broker(self) -> None:
        """Readiness: ask the brokers for metadata now and then; no answer in time means not reachable.
        Runs until cancelled; logs once when the brokers go away and once when they are back."""
        interval = self._settings.broker_probe_interval_ms / 1000
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self.consumer.topics()
                reachable = True
            except (KafkaError, TimeoutError, OSError):
                reachable = False
            if reachable != self._readiness.broker_reachable:
                log.warning("brokers %s", "answer again" if reachable else "do not answer metadata requests")
            self._readiness.update(broker_reachable=reachable)
            await asyncio.sleep(interval)

    def assigned(self, assigned: set[TopicPartition]) -> None:
        log.info(
            "assigned partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned) or "none"
        )
        self._metrics.partitions.assigned_partitions(len(assigned))
        # A member without partitions (more workers than partitions) has joined all the same.
        self._readiness.update(group_joined=True)

    async def opened(self, assigned: set[TopicPartition]) -> None:
        """After an assignment, the owner's preparations (exactly once: fence the previous owners, then
        read from the commit)."""
        self.generation += 1
        self._fenced -= assigned
        if self._on_assigned is not None and assigned:
            await self._on_assigned(assigned)

    async def read_from_commit(self, partitions: set[TopicPartition]) -> None:
        """Position partitions at the group's committed offset, asked of the coordinator now (the library
        may have read it before a previous owner's last transaction ended, and may have fetched from it
        meanwhile); without a commit, where auto_offset_reset says. All are positioned together after
        the last question, with no wait in between: the caller may start taking their records at once."""
        offsets: dict[TopicPartition, int | None] = {}
        for tp in partitions:
            offsets[tp] = await self.consumer.committed(tp)
        missing = [tp for tp, offset in offsets.items() if offset is None]
        if missing:
            earliest = self._settings.auto_offset_reset == "earliest"
            ask = self.consumer.beginning_offsets if earliest else self.consumer.end_offsets
            offsets.update(await ask(missing))
        for tp, offset in offsets.items():
            assert offset is not None
            self._seek(tp, offset)

    def fence(self, tp: TopicPartition) -> None:
        """Stop reading a partition whose answers another worker now writes, until it is given again."""
        self._fenced.add(tp)
        if tp in self.consumer.assignment():
            self.consumer.pause(tp)

    def unfence(self, tp: TopicPartition) -> None:
        self._fenced.discard(tp)
        if tp in self.consumer.assignment() and not self._load_paused and not self._stopping:
            self.consumer.resume(tp)

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        self._metrics.partitions.forget_partitions((tp.topic, tp.partition) for tp in revoked)
        self._holds.forget(revoked)
        for tp in revoked:
            self._handed_out.pop(tp, None)
        if revoked:
            log.info("revoking partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked))
            await self._on_revoked(revoked)
