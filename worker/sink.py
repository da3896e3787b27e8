"""The sink: publish answers, mark their requests done, commit offsets only up to what was acknowledged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import TopicPartition

from worker.config import WorkerSettings
from worker.errors import PublishError
from worker.intake import Outgoing
from worker.metrics import WorkerMetrics
from worker.offsets import OffsetTracker
from worker.publisher import Publisher, broker_grants_producer_ids
from worker.transactions import OnFenced, PartitionTransactions

log = logging.getLogger(__name__)

CommitFn = Callable[[dict[TopicPartition, int]], Awaitable[None]]


class Sink:
    """Owns the publisher and the offset tracker: `deliver` publishes and marks done, `commit` commits.

    At least once (the default): an offset is committed only after the broker acknowledged the answers of
    every request up to it (result and, for a rejected record, its dead-letter copy).

    Exactly once (setting `delivery`): each requests partition's answers are written together with its
    consumed offset in Kafka transactions (worker.transactions); `open` the partitions when they are
    assigned, before reading them. `commit` then only waits for what can be written to be.
    """

    def __init__(
        self, settings: WorkerSettings, metrics: WorkerMetrics, on_fenced: OnFenced | None = None
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._publisher = Publisher(settings)
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._transactions = (
            PartitionTransactions(settings, self._tracker.committable, self._fenced)
            if settings.exactly_once
            else None
        )
        self._on_fenced = on_fenced
        self._commit_fn: CommitFn | None = None
        self._commit_lock = asyncio.Lock()
        self._background: asyncio.Task[bool] | None = None
        self._failing_since: float | None = None
        self._failures = 0

    async def start(self, commit: CommitFn) -> None:
        self._commit_fn = commit
        if self._transactions is None:
            await self._publisher.start()
            return
        # Every partition's answers go through its own transactional producer; this one is not used.
        if not await broker_grants_producer_ids(self._settings.kafka_client_kwargs()):
            raise PublishError(
                "exactly-once delivery needs a broker with transactions (Apache Kafka 0.11 or newer); "
                "these brokers grant no producer ids (the embedded broker has no transactions): use "
                "delivery=at-least-once with them"
            )
        log.info("delivery: exactly once, one transaction per requests partition and batch")

    async def stop(self) -> None:
        """Flush what is buffered, then close the producers."""
        if self._transactions is not None:
            await self._transactions.close()
        else:
            await self._publisher.stop()

    async def open(self, partitions: Iterable[TopicPartition]) -> None:
        """Exactly once: start the transactional producers of assigned partitions, fencing their previous
        owners (nothing to do at least once)."""
        if self._transactions is not None:
            await self._transactions.open(partitions)

    def _fenced(self, tp: TopicPartition) -> None:
        self._tracker.drop([tp])
        if self._on_fenced is not None:
            self._on_fenced(tp)

    def activate(self, partitions: Iterable[TopicPartition]) -> None:
        """Exactly once: opened partitions, now positioned at the commit, take records."""
        if self._transactions is not None:
            self._transactions.activate(partitions)

    def track(self, tp: TopicPartition, offset: int) -> bool:
        """Track a fetched record; False when it is not to be answered (exactly once: its partition is
        not open for records, the record is read again once it is)."""
        if self._transactions is not None and not self._transactions.owns(tp):
            return False
        self._tracker.track(tp, offset)
        return True

    def track_range(self, tp: TopicPartition, first: int, last: int) -> None:
        """Offsets answered together by one record (a range skipped unread), done as `first`."""
        if self._transactions is None or self._transactions.owns(tp):
            self._tracker.track_range(tp, first, last)

    def pending(self, partitions: Iterable[TopicPartition] | None = None) -> int:
        """Fetched requests not yet answered, or answered but not yet written in a transaction (over
        `partitions`, all when None)."""
        partitions = None if partitions is None else list(partitions)
        held = 0 if self._transactions is None else self._transactions.held(partitions)
        return self._tracker.pending(partitions) + held

    async def deliver(self, outgoing: Outgoing) -> None:
        """Publish the records (raises PublishError when the broker does not take them), then mark the
        requests they answer done; exactly once, mark them done and wait until a transaction wrote them."""
        started = time.monotonic()
        if self._transactions is not None:
            # Only answers to requests open in this ownership of their partition are held: an answer that
            # comes late from an earlier ownership, or for a record read before the partition was opened
            # (it is read again from the commit), or a second answer to one request, is dropped.
            answering = {(tp, offset) for tp, offset in outgoing.answered() if self._tracker.done(tp, offset)}
            held = [
                (tp, offset, record, outgoing.tally)
                for record, (tp, offset) in zip(outgoing.records, outgoing.sources, strict=True)
                if (tp, offset) in answering
            ]
            # Nothing held (every answer a stale one): nothing is written, so nothing is counted published.
            if held and await self._transactions.hold(held):
                self._metrics.published(outgoing.tally, time.monotonic() - started)
            return
        swapped = await self._publisher.deliver(outgoing.records)
        for sent, instead_of in swapped:
            outgoing.tally.swap(sent, instead_of)
        self._metrics.published(outgoing.tally, time.monotonic() - started)
        for tp, offset in outgoing.answered():
            self._tracker.done(tp, offset)

    def commit_soon(self) -> None:
        """Commit in the background: the fetch loop never waits on a commit (a broker away for a while
        would block it for the commit timeout each time). Exactly once, nothing to do: every transaction
        commits its offset."""
        if self._transactions is not None:
            return
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self.commit(), name="commit")

    async def commit(self, partitions: set[TopicPartition] | None = None) -> bool:
        """Commit what was answered (of `partitions`, all when None); False when the commit failed.
        Exactly once, transactions commit the offsets: this waits (bounded) until what can be written is."""
        if self._transactions is not None:
            try:
                async with asyncio.timeout(self._settings.commit_timeout_ms / 1000):
                    await self._transactions.flushed(partitions)
            except TimeoutError:
                return False
            return True
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

    async def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget revoked partitions: late answers for them are not committed by this worker (exactly
        once, their producers are closed: the next owner's fence them anyway)."""
        partitions = list(partitions)
        self._tracker.drop(partitions)
        if self._transactions is not None:
            await self._transactions.close(partitions)
