"""Per-partition offset gap tracking: commit only up to the first request whose result is not yet acked."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)


class PartitionOffsets:
    """Offsets of one partition that were fetched, and which of them are done.

    Done means the broker acknowledged everything the worker publishes for that record. The committable
    offset is the lowest offset not yet done, or one past the highest tracked offset when all are done.
    Using the lowest open offset, rather than counting contiguous offsets, stays right when a topic's
    offsets have gaps (compaction, transaction markers).
    """

    def __init__(self) -> None:
        self._open: set[int] = set()
        # Min-heap over open offsets; entries already done are removed lazily when they reach the top.
        self._heap: list[int] = []
        self._next: int | None = None

    def __len__(self) -> int:
        """Number of tracked offsets not yet done."""
        return len(self._open)

    def track(self, offset: int) -> None:
        """Record a fetched offset as in flight (tracking it again while open is a no-op)."""
        if offset < 0:
            raise ValueError(f"offset must not be negative, got {offset}")
        if offset in self._open:
            return
        self._open.add(offset)
        heapq.heappush(self._heap, offset)
        if self._next is None or offset >= self._next:
            self._next = offset + 1

    def track_range(self, first: int, last: int) -> None:
        """Track offsets `first` to `last` as one entry that `done(first)` completes (a range of records
        answered as a whole, such as a batch skipped unread): until then nothing from `first` on is
        committable, and afterwards the commit may pass `last`."""
        if last < first:
            raise ValueError(f"empty range {first}-{last}")
        self.track(first)
        if self._next is None or last >= self._next:
            self._next = last + 1

    def done(self, offset: int) -> bool:
        """Mark a tracked offset done; returns False when it is not open (untracked or already done)."""
        if offset not in self._open:
            return False
        self._open.discard(offset)
        while self._heap and self._heap[0] not in self._open:
            heapq.heappop(self._heap)
        return True

    def committable(self) -> int | None:
        """The offset to commit (the next record to read after a restart), or None if nothing was tracked."""
        if self._heap:
            return self._heap[0]
        return self._next


class OffsetTracker(Generic[P]):
    """Gap tracking over many partitions, plus what was last committed, so commits send only changes."""

    def __init__(self) -> None:
        self._partitions: dict[P, PartitionOffsets] = {}
        self._committed: dict[P, int] = {}

    def track(self, partition: P, offset: int) -> None:
        self._partitions.setdefault(partition, PartitionOffsets()).track(offset)

    def track_range(self, partition: P, first: int, last: int) -> None:
        self._partitions.setdefault(partition, PartitionOffsets()).track_range(first, last)

    def done(self, partition: P, offset: int) -> bool:
        """Mark an offset done; False when the partition or offset is not tracked (e.g. revoked since)."""
        offsets = self._partitions.get(partition)
        return offsets.done(offset) if offsets is not None else False

    def pending(self, partitions: Iterable[P] | None = None) -> int:
        """Open offsets over the given partitions (all when None)."""
        if partitions is None:
            return sum(len(o) for o in self._partitions.values())
        return sum(len(self._partitions[p]) for p in partitions if p in self._partitions)

    def committable(self, partition: P) -> int | None:
        """One partition's committable offset; None when nothing of it is tracked."""
        offsets = self._partitions.get(partition)
        return offsets.committable() if offsets is not None else None

    def to_commit(self, partitions: Iterable[P] | None = None) -> dict[P, int]:
        """Committable offsets that moved since the last `mark_committed`, optionally for some partitions."""
        chosen = self._partitions.keys() if partitions is None else set(partitions) & self._partitions.keys()
        result: dict[P, int] = {}
        for partition in chosen:
            offset = self._partitions[partition].committable()
            if offset is not None and self._committed.get(partition) != offset:
                result[partition] = offset
        return result

    def mark_committed(self, offsets: dict[P, int]) -> None:
        """Remember what the broker accepted, so the next `to_commit` skips unchanged partitions."""
        for partition, offset in offsets.items():
            if partition in self._partitions:
                self._committed[partition] = offset

    def drop(self, partitions: Iterable[P]) -> None:
        """Forget revoked partitions: late completions for them are ignored, a reassignment starts afresh."""
        for partition in partitions:
            self._partitions.pop(partition, None)
            self._committed.pop(partition, None)
