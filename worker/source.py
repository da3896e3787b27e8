"""The source: the consumer group member that fetches requests, pauses under load and reports its state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.config import WorkerSettings
from worker.health import Readiness
from worker.logs import PAUSING, RESUMING
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

OnRevoked = Callable[[set[TopicPartition]], Awaitable[None]]


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, source: Source) -> None:
        self._source = source

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._source.revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._source.assigned(assigned)


class Source:
    """One member of the consumer group. `fetch` must be called regularly even while paused: polling is
    what keeps the member in the group. Before partitions are taken away, `on_revoked` lets the owner
    finish and commit their in-flight requests."""

    def __init__(
        self, settings: WorkerSettings, metrics: WorkerMetrics, readiness: Readiness, on_revoked: OnRevoked
    ) -> None:
        self._settings = settings
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
            # How long the group waits for members to rejoin: a revocation finishing in-flight work needs
            # up to its bound (aiokafka's default, the session timeout, would evict this worker mid-wait).
            rebalance_timeout_ms=max(settings.max_poll_interval_ms, 2 * settings.revocation_timeout_ms),
        )

    async def start(self) -> None:
        self.consumer.subscribe([self._settings.requests_topic], listener=_Listener(self))
        await self.consumer.start()
        self._readiness.update(broker_reachable=True)

    async def stop(self) -> None:
        """Leave the group (a static member stays until its session times out) and close."""
        await self.consumer.stop()

    async def fetch(self, timeout_ms: int, max_records: int) -> list[ConsumerRecord[bytes, bytes]]:
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        return [record for batch in fetched.values() for record in batch]

    def fully_paused(self) -> bool:
        """Every assigned partition is paused (and there is at least one)."""
        assignment = self.consumer.assignment()
        return bool(assignment) and self.consumer.paused() >= assignment

    def pause_all(self) -> None:
        self.consumer.pause(*self.consumer.assignment())

    def apply_backpressure(self, in_flight: int) -> None:
        """Pause fetching at max_inflight_requests, resume at half of it (so a busy worker does not flap)."""
        limit = self._settings.max_inflight_requests
        paused = self.consumer.paused()
        if in_flight >= limit:
            if not paused:
                log.info(PAUSING, in_flight, limit)
            self.pause_all()
        elif paused and in_flight <= limit // 2:
            log.info(RESUMING, in_flight)
            self.consumer.resume(*paused)

    async def sample_state(self, in_flight: int) -> None:
        """In-flight, paused and per-partition lag (high-water mark minus position) into the metrics."""
        consumer = self.consumer
        self._metrics.state(in_flight, len(consumer.paused()))
        lags: dict[tuple[str, int], int] = {}
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is None:  # nothing fetched from it yet: the position may not be known either
                continue
            with contextlib.suppress(KafkaError, TimeoutError):
                async with asyncio.timeout(0.05):
                    lags[(tp.topic, tp.partition)] = highwater - await consumer.position(tp)
        self._metrics.set_lag(lags)

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
        self._metrics.assigned_partitions(len(assigned))
        # A member without partitions (more workers than partitions) has joined all the same.
        self._readiness.update(group_joined=True)

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        self._metrics.forget_partitions((tp.topic, tp.partition) for tp in revoked)
        if revoked:
            log.info("revoking partitions: %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked))
            await self._on_revoked(revoked)
