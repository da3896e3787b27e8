"""Exactly-once delivery: each requests partition's answers and consumed offset in Kafka transactions.

One transactional producer per assigned requests partition (transactional id `<prefix>.<topic>.<partition>`,
as Kafka Streams did before KIP-447): a worker that is given a partition starts its producer, which fences
the partition's previous owner and aborts what that one left open, and only then reads where the group's
commit stands. aiokafka commits offsets in a transaction without the group's generation (TxnOffsetCommit
v0), so fencing by generation is not open to it; by transactional id it needs nothing of the client.

A partition's answers are held until every request before them is answered too: a transaction then writes
them (results, dead letters, replies) with the offset past them, so a reader with read_committed sees an
answer exactly when the group's commit has passed its request. One transaction per partition runs at a
time; what finishes while it runs goes into the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import TopicPartition

from worker.config import WorkerSettings
from worker.errors import PublishError
from worker.metrics import ResultTally
from worker.publisher import OutRecord, Publisher

log = logging.getLogger(__name__)

Committable = Callable[[TopicPartition], int | None]
OnFenced = Callable[[TopicPartition], None]


@dataclass(eq=False)
class _Held:
    """The records answering one request, and the tally of the batch they came in (for reply swaps)."""

    records: list[OutRecord] = field(default_factory=list)
    tallies: list[ResultTally] = field(default_factory=list)


class _Partition:
    """One requests partition's transactional producer, its held answers and its flushing task."""

    def __init__(self, tp: TopicPartition, publisher: Publisher) -> None:
        self.tp = tp
        self.publisher = publisher
        self.held: dict[int, _Held] = {}  # request offset -> its answers, until a transaction writes them
        self.committed: int | None = None  # the offset our last transaction committed
        self.waiters: list[tuple[int, asyncio.Future[bool]]] = []  # (offset, resolved when written)
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.active = False  # positioned at the commit: takes records

    def settle(self, upto: int | None, written: bool) -> None:
        """Resolve the waiters for offsets below `upto` (all when None) with `written`."""
        keep = []
        for offset, waiter in self.waiters:
            if upto is None or offset < upto:
                if not waiter.done():
                    waiter.set_result(written)
            else:
                keep.append((offset, waiter))
        self.waiters = keep


class PartitionTransactions:
    """The transactional producers of the partitions this worker owns.

    `open` before a partition's records are read (it fences the previous owner), `activate` once it is
    positioned at the group's commit, `hold` the answers of
    finished requests and wait for them to be written, `close` when the partition is revoked. A producer
    fenced meanwhile (the partition has a newer owner) loses what it held: nothing of it was visible, and
    the new owner answers those requests from the committed offset on.
    """

    def __init__(self, settings: WorkerSettings, committable: Committable, on_fenced: OnFenced) -> None:
        self._settings = settings
        self._committable = committable
        self._on_fenced = on_fenced
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._topics: dict[str, tuple[bool, float]] = {}  # reply topics known, shared by the producers
        self._failure: PublishError | None = None
        self.transactions = 0  # committed, for the logs and the tests

    def owns(self, tp: TopicPartition) -> bool:
        """Whether this worker answers the partition's records now (opened and activated)."""
        part = self._partitions.get(tp)
        return part is not None and part.active

    def activate(self, partitions: Iterable[TopicPartition]) -> None:
        """Opened partitions take records from now on (they were positioned at the group's commit)."""
        for tp in partitions:
            if tp in self._partitions:
                self._partitions[tp].active = True

    def held(self, partitions: Iterable[TopicPartition] | None = None) -> int:
        """Requests answered but not yet written (over `partitions`, all when None)."""
        chosen = (
            self._partitions.values()
            if partitions is None
            else (self._partitions[tp] for tp in partitions if tp in self._partitions)
        )
        return sum(len(p.held) for p in chosen)

    async def open(self, partitions: Iterable[TopicPartition]) -> None:
        """Start the producers of newly assigned partitions, together: each fences its partition's previous
        owner and waits until what that one left open is aborted."""
        fresh = [tp for tp in partitions if tp not in self._partitions]
        if not fresh:
            return
        started = time.monotonic()
        publishers = [
            Publisher(self._settings, self._settings.transactional_id(tp.topic, tp.partition), self._topics)
            for tp in fresh
        ]
        results = await asyncio.gather(*(p.start() for p in publishers), return_exceptions=True)
        failed = [(tp, r) for tp, r in zip(fresh, results, strict=True) if isinstance(r, BaseException)]
        for tp, publisher, result in zip(fresh, publishers, results, strict=True):
            if isinstance(result, BaseException):
                with contextlib.suppress(Exception):
                    await publisher.stop()
                continue
            part = _Partition(tp, publisher)
            part.task = asyncio.get_running_loop().create_task(self._flush(part), name=f"txn-{tp.partition}")
            self._partitions[tp] = part
        if failed:
            raise PublishError(
                f"could not start the transactional producers of {[tp for tp, _ in failed]}: {failed[0][1]!r}"
            )
        log.info(
            "transactional producers of %d partitions ready in %.2f s", len(fresh), time.monotonic() - started
        )

    async def hold(self, held: Iterable[tuple[TopicPartition, int, OutRecord, ResultTally]]) -> bool:
        """Hold answers until a transaction writes them with their partitions' offsets; wait for that.

        True when all were written; False when some partition was revoked or fenced first (its answers are
        dropped: the next owner gives them). Raises PublishError when a transaction could not be written.
        """
        if self._failure is not None:
            raise self._failure
        loop = asyncio.get_running_loop()
        last: dict[TopicPartition, int] = {}
        unowned = False
        for tp, offset, record, tally in held:
            part = self._partitions.get(tp)
            if part is None:
                unowned = True
                continue
            entry = part.held.setdefault(offset, _Held())
            entry.records.append(record)
            entry.tallies.append(tally)
            last[tp] = max(offset, last.get(tp, offset))
        waiters = []
        for tp, offset in last.items():
            part = self._partitions[tp]
            waiter: asyncio.Future[bool] = loop.create_future()
            part.waiters.append((offset, waiter))
            waiters.append(waiter)
            part.wake.set()
        written = all(await asyncio.gather(*waiters)) and not unowned
        if self._failure is not None:
            raise self._failure
        return written

    async def flushed(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Until nothing of `partitions` (all when None) that can be written waits to be."""
        chosen = (
            list(self._partitions.values())
            if partitions is None
            else [self._partitions[tp] for tp in partitions if tp in self._partitions]
        )
        while any(self._writable(p) for p in chosen) and self._failure is None:
            for p in chosen:
                p.wake.set()
            await asyncio.sleep(0.005)

    def _writable(self, part: _Partition) -> bool:
        upto = self._committable(part.tp)
        return not part.closed and upto is not None and any(offset < upto for offset in part.held)

    async def close(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Stop the producers of revoked partitions (all when None); answers still held are dropped."""
        chosen = (
            list(self._partitions)
            if partitions is None
            else [tp for tp in partitions if tp in self._partitions]
        )
        parts = [self._partitions.pop(tp) for tp in chosen]
        for part in parts:
            self._discard(part)
        await asyncio.gather(*(self._stop(part) for part in parts))

    def _discard(self, part: _Partition) -> None:
        part.closed = True
        if part.held:
            log.warning(
                "%d answered requests of %s dropped unwritten: the partition's next owner answers them",
                len(part.held), part.tp,
            )  # fmt: skip
        part.held.clear()
        part.settle(None, written=False)
        if part.task is not None and part.task is not asyncio.current_task():
            part.task.cancel()

    async def _stop(self, part: _Partition) -> None:
        if part.task is not None and part.task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await part.task
        with contextlib.suppress(Exception):  # a fenced producer's close raises what fenced it
            await part.publisher.stop()

    async def _flush(self, part: _Partition) -> None:
        """Write what can be written, one transaction at a time, until the partition is closed."""
        group = self._settings.group_id
        while not part.closed:
            await part.wake.wait()
            part.wake.clear()
            while not part.closed:
                upto = self._committable(part.tp)
                if upto is None or (part.committed is not None and upto <= part.committed):
                    break
                offsets = sorted(offset for offset in part.held if offset < upto)
                if not offsets:
                    break  # nothing answered below it: the offset moves with the next answers written
                entries = [part.held[offset] for offset in offsets]
                records = [record for entry in entries for record in entry.records]
                try:
                    swapped = await part.publisher.deliver_in_transaction(records, {part.tp: upto}, group)
                except ProducerFenced:
                    self._fenced(part)
                    return
                except PublishError as error:
                    self._failed(error)
                    return
                except KafkaError as error:  # a state the producer cannot leave: the worker stops
                    self._failed(PublishError(f"a transaction for {part.tp} failed: {error!r}"))
                    return
                self.transactions += 1
                _apply_swaps(entries, swapped)
                for offset in offsets:
                    del part.held[offset]
                part.committed = upto
                part.settle(upto, written=True)

    def _fenced(self, part: _Partition) -> None:
        log.warning(
            "the transactional producer of %s was fenced: another worker owns the partition now (or a "
            "transaction outlived transaction_timeout_ms); %d answered requests left to it",
            part.tp, len(part.held),
        )  # fmt: skip
        self._partitions.pop(part.tp, None)
        self._discard(part)
        asyncio.get_running_loop().create_task(self._stop(part), name=f"txn-stop-{part.tp.partition}")
        self._on_fenced(part.tp)

    def _failed(self, error: PublishError) -> None:
        """A transaction could not be written within publish_timeout_ms: the worker stops uncommitted."""
        self._failure = error
        for part in self._partitions.values():
            part.settle(None, written=False)


def _apply_swaps(entries: list[_Held], swapped: list[tuple[OutRecord, OutRecord]]) -> None:
    """Count a reply-topic result sent to the results topic instead in its batch's tally."""
    if not swapped:
        return
    tallies = {
        id(record): tally
        for entry in entries
        for record, tally in zip(entry.records, entry.tallies, strict=True)
    }
    for sent, instead_of in swapped:
        tally = tallies.get(id(instead_of))
        if tally is not None:
            tally.swap(sent, instead_of)
