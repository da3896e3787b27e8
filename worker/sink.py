"""The sink: publish answers, mark their requests done, commit offsets only up to what was acknowledged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import TopicPartition

from worker.config import WorkerSettings
from worker.intake import Outgoing
from worker.metrics import WorkerMetrics
from worker.offsets import OffsetTracker
from worker.publisher import Publisher

log = logging.getLogger(__name__)

CommitFn = Callable[[dict[TopicPartition, int]], Awaitable[None]]


class Sink:
    """Owns the publisher and the offset tracker: `deliver` publishes and marks done, `commit` commits.

    Delivery is at least once: an offset is committed only after the broker acknowledged the answers of
    every request up to it (result and, for a rejected record, its dead-letter copy).
    """

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._publisher = Publisher(settings)
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._commit_fn: CommitFn | None = None
        self._commit_lock = asyncio.Lock()
        self._background: asyncio.Task[bool] | None = None
        self._failing_since: float | None = None
        self._failures = 0

    async def start(self, commit: CommitFn) -> None:
        self._commit_fn = commit
        await self._publisher.start()

    async def stop(self) -> None:
        """Flush what is buffered, then close the producer."""
        await self._publisher.stop()

    def track(self, tp: TopicPartition, offset: int) -> None:
        self._tracker.track(tp, offset)

    def track_range(self, tp: TopicPartition, first: int, last: int) -> None:
        """Offsets answered together by one record (a range skipped unread), done as `first`."""
        self._tracker.track_range(tp, first, last)

    def pending(self, partitions: Iterable[TopicPartition] | None = None) -> int:
        """Fetched requests not yet answered (over `partitions`, all when None)."""
        return self._tracker.pending(partitions)

    async def deliver(self, outgoing: Outgoing, done: Iterable[tuple[TopicPartition, int]]) -> None:
        """Publish the records (raises PublishError when the broker does not take them), then mark the
        requests they answer done."""
        started = time.monotonic()
        swapped = await self._publisher.deliver(outgoing.records)
        for sent, instead_of in swapped:
            outgoing.tally.swap(sent, instead_of)
        self._metrics.published(outgoing.tally, time.monotonic() - started)
        for tp, offset in done:
            self._tracker.done(tp, offset)

    def commit_soon(self) -> None:
        """Commit in the background: the fetch loop never waits on a commit (a broker away for a while
        would block it for the commit timeout each time)."""
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self.commit(), name="commit")

    async def commit(self, partitions: set[TopicPartition] | None = None) -> bool:
        """Commit what was answered (of `partitions`, all when None); False when the commit failed."""
        async with self._commit_lock:
            offsets = self._tracker.to_commit(partitions)
            if not offsets or self._commit_fn is None:
                return True
            try:
                # aiokafka retries a commit until the coordinator answers, forever while the broker is
                # away; past the bound the group has moved on anyway, and a stop must not hang on it.
                async with asyncio.timeout(self._settings.commit_timeout_ms / 1000):
                    await self._commit_fn(offsets)
            except (CommitFailedError, KafkaError, TimeoutError) as exc:
                # Partitions lost in a rebalance, or the broker away: the next owner re-reads from the last
                # commit, so this means duplicates, never loss.
                self._commit_failed(len(offsets), exc)
                return False
            self._commit_ok()
            self._tracker.mark_committed(offsets)
            return True

    def _commit_failed(self, partitions: int, exc: BaseException) -> None:
        self._metrics.commit_failed()
        self._failures += 1
        if self._failing_since is None:  # one line per outage, and one when it ends
            self._failing_since = time.monotonic()
            log.warning(
                "commit of %d partitions failed: %r (retrying every commit interval)", partitions, exc
            )

    def _commit_ok(self) -> None:
        self._metrics.committed()
        if self._failing_since is not None:
            log.warning(
                "commits work again after %d failed attempts over %.0f s",
                self._failures, time.monotonic() - self._failing_since,
            )  # fmt: skip
            self._failing_since, self._failures = None, 0

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget revoked partitions: late answers for them are not committed by this worker."""
        self._tracker.drop(partitions)
