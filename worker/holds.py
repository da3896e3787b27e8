"""Partitions held at records the worker cannot read: reported, retried with backoff, skipped only when asked.

A held partition stays paused at the first offset it could not read, so nothing past it is fetched or
committed, while every other partition flows. Its read is retried with backoff (a broker that served a
damaged copy, an ACL fixed meanwhile: a transient cause clears by itself). With
`undecodable_skip_after_ms`, a batch still unreadable after that long is skipped: the owner publishes its
offset range to the dead-letter topic and tracks it, so that the commit passes it only once that record is
acknowledged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from worker.health import Readiness
from worker.metrics import WorkerMetrics
from worker.undecodable import Cause, FetchGuard, RawBatch, Unreadable, classify, describe, read_raw_batch

log = logging.getLogger(__name__)

# Retries of a held partition: after half a second, then twice as long each time, at most this long apart.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0
# A partition that stays held is logged again at most this often (its first hold is always logged).
REPEAT_LOG_S = 60.0


def retry_delay(attempts: int) -> float:
    """Seconds before the next read of a partition whose read has failed `attempts` times."""
    return float(min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** max(0, attempts - 1)))


@dataclass
class Hold:
    """A partition stopped at `offset`, the first offset it could not read."""

    tp: TopicPartition
    offset: int
    cause: Cause
    message: str
    batch: RawBatch | None  # the batch holding `offset`, as the broker stores it (None: not readable)
    since: float  # monotonic
    attempts: int = 1  # reads that stopped here
    retry_at: float = 0.0
    retrying: bool = False  # resumed for a retry whose outcome is not known yet
    logged_at: float = 0.0

    @property
    def last_offset(self) -> int:
        """The last offset a skip passes over: the rest of the batch, or this offset alone when the batch is
        not known."""
        batch = self.batch
        if batch is not None and batch.base_offset <= self.offset <= batch.last_offset:
            return batch.last_offset
        return self.offset

    def where(self) -> str:
        return f"{self.tp.topic}[{self.tp.partition}]"


Skip = Callable[[Hold], None]
Seek = Callable[[TopicPartition, int], None]


class PartitionHolds:
    """The held partitions of one consumer. `after_fetch` after every getmany, `tick` now and then."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        guard: FetchGuard,
        metrics: WorkerMetrics,
        readiness: Readiness,
        seek: Seek,
        skip_after_s: float,
        skip: Skip,
    ) -> None:
        self._consumer = consumer
        self._guard = guard
        self._metrics = metrics
        self._readiness = readiness
        self._seek = seek
        self._skip_after_s = skip_after_s
        self._skip = skip
        self._holds: dict[TopicPartition, Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def blocked(self) -> set[TopicPartition]:
        """Held partitions that must stay paused (a partition being retried is not blocked)."""
        return {tp for tp, hold in self._holds.items() if not hold.retrying}

    async def after_fetch(self, returned: Iterable[TopicPartition]) -> None:
        """A retried partition that returned records reads again; what the guard caught is held."""
        for tp in returned:
            hold = self._holds.get(tp)
            if hold is not None and hold.retrying:
                self._clear(hold)
        for unreadable in await self._guard.take():
            await self._found(unreadable)

    async def _found(self, unreadable: Unreadable) -> None:
        now = time.monotonic()
        tp = unreadable.tp
        hold = self._holds.get(tp)
        if hold is not None and hold.offset == unreadable.offset:  # a retry failed where the hold is
            hold.attempts += 1
            hold.retrying = False
            hold.retry_at = now + retry_delay(hold.attempts)
            self._metrics.partitions.undecodable(tp.topic, tp.partition, hold.cause)
            if now - hold.logged_at >= REPEAT_LOG_S:
                hold.logged_at = now
                log.warning(
                    "%s still held at offset %d after %d reads over %.0f s (%s): %s",
                    hold.where(), hold.offset, hold.attempts, now - hold.since, hold.cause, hold.message,
                )  # fmt: skip
            return
        batch = await read_raw_batch(self._consumer, tp, unreadable.offset)
        cause = classify(unreadable, batch)
        hold = Hold(
            tp, unreadable.offset, cause, describe(cause, batch, unreadable.error), batch, now,
            retry_at=now + retry_delay(1), logged_at=now,
        )  # fmt: skip
        self._holds[tp] = hold
        self._metrics.partitions.undecodable(tp.topic, tp.partition, cause)
        skip = (
            f"skipped to the dead-letter topic after {self._skip_after_s:g} s"
            if self._skip_after_s
            else "held until it reads (undecodable_skip_after_ms is 0)"
        )
        log.warning(
            "%s stops at offset %d, which the worker cannot read (%s): %s; the partition is retried with "
            "backoff and %s, while the others flow",
            hold.where(), hold.offset, cause, hold.message, skip,
        )  # fmt: skip
        self._report()

    async def tick(self, load_paused: bool) -> None:
        """Retries and skips that are due. `load_paused`: backpressure has paused fetching (a retry waits
        for it to lift; a skip does not, it fetches nothing)."""
        now = time.monotonic()
        for hold in list(self._holds.values()):
            if hold.retrying:
                # Neither records nor a failure came back: the position says whether the read got past.
                if await self._consumer.position(hold.tp) > hold.offset:
                    self._clear(hold)
            elif self._skip_after_s and now - hold.since >= self._skip_after_s:
                await self._skip_past(hold, load_paused)
            elif now >= hold.retry_at and not load_paused:
                hold.retrying = True
                self._seek(hold.tp, hold.offset)  # drops whatever the fetcher kept of the failed read
                self._consumer.resume(hold.tp)

    async def _skip_past(self, hold: Hold, load_paused: bool) -> None:
        if hold.batch is None:  # not readable when the hold began: its range may be known now
            hold.batch = await read_raw_batch(self._consumer, hold.tp, hold.offset)
        last = hold.last_offset
        self._skip(hold)
        self._metrics.partitions.skipped(hold.tp.topic, hold.tp.partition, hold.cause, last - hold.offset + 1)
        log.warning(
            "%s: skipping offsets %d-%d, unreadable for %.0f s (%s); the range goes to the dead-letter topic",
            hold.where(), hold.offset, last, time.monotonic() - hold.since, hold.cause,
        )  # fmt: skip
        self._seek(hold.tp, last + 1)
        if not load_paused:
            self._consumer.resume(hold.tp)
        del self._holds[hold.tp]
        self._report()

    def _clear(self, hold: Hold) -> None:
        log.warning(
            "%s reads again from offset %d after %d failed reads over %.0f s",
            hold.where(), hold.offset, hold.attempts, time.monotonic() - hold.since,
        )  # fmt: skip
        del self._holds[hold.tp]
        self._report()

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions this worker no longer owns: their holds go with them (the next owner finds its own)."""
        for tp in partitions:
            self._holds.pop(tp, None)
        self._report()

    def _report(self) -> None:
        self._metrics.partitions.held_partitions(len(self._holds))
        self._readiness.hold(
            {
                hold.where(): {"offset": hold.offset, "cause": hold.cause, "message": hold.message}
                for hold in self._holds.values()
            }
        )
