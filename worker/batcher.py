"""Token-budget batching: groups prepared requests into model batches; pure logic, no I/O."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from models.plan import group_cut

T = TypeVar("T")


@dataclass(frozen=True)
class Batch(Generic[T]):
    """A closed batch: its items in arrival order and the tokens they compute together."""

    items: tuple[T, ...]
    tokens: int


class TokenBudgetBatcher(Generic[T]):
    """Collects items into a batch and closes it on a token budget, a request count or a maximum wait.

    - A batch never holds more than `max_tokens` tokens, except a single item larger than the budget,
      which forms a batch alone (the model splits or rejects it; holding it back would stall the stream).
    - A batch closes as soon as it holds `max_requests` items or exactly `max_tokens` tokens.
    - A batch closes `max_wait_s` after its first item arrived (see `due_in` / `take_due`).
    The caller owns the clock loop: it asks `due_in()` how long it may wait for more items.

    `measure(items)`, when given, is what items cost together when that can be less than the sum of their
    tokens (prompts sharing a prefix computed once): an item that would take the sum over the budget is
    measured with the batch, and joins it when what they compute together fits. `joins(earlier, item)`,
    given with it, says whether two items share such a prefix: when an item closes the batch, the items at
    the batch's end sharing one with it move to the next batch with it, so their prefix is computed once
    and not in both (the rule of `models.plan.group_cut`, which the engine's own split follows). Those
    moved items keep the time they started waiting: the maximum wait still bounds every item's.
    """

    def __init__(
        self,
        max_tokens: int,
        max_requests: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        measure: Callable[[list[T]], int] | None = None,
        joins: Callable[[T, T], bool] | None = None,
    ) -> None:
        if max_tokens <= 0 or max_requests <= 0 or max_wait_s < 0:
            raise ValueError("max_tokens and max_requests must be positive and max_wait_s not negative")
        self._max_tokens = max_tokens
        self._max_requests = max_requests
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._measure = measure
        self._joins = joins
        self._items: list[T] = []
        self._tokens = 0  # what the batch computes: measured, or an upper bound (the sum since measured)
        self._opened_at = 0.0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def pending_tokens(self) -> int:
        return self._tokens

    @property
    def items(self) -> tuple[T, ...]:
        """The open batch's items, in arrival order."""
        return tuple(self._items)

    def take(self, taken: Sequence[T]) -> None:
        """Remove these items (compared by identity) from the open batch: they join a batch closed earlier.
        The rest stay open, measured again, their wait still counted from when the batch opened."""
        if self._measure is None:
            raise ValueError("taking items out of the open batch needs a measure to count what stays")
        gone = {id(item) for item in taken}
        self._items = [item for item in self._items if id(item) not in gone]
        self._tokens = self._measure(self._items) if self._items else 0

    def add(self, item: T, tokens: int) -> list[Batch[T]]:
        """Add one item; return the batches this closes (zero, one or two), oldest first."""
        if tokens < 0:
            raise ValueError(f"tokens must not be negative, got {tokens}")
        closed: list[Batch[T]] = []
        together = self._tokens + tokens  # an upper bound where a measure may find less
        if self._items and together >= self._max_tokens and self._measure is not None:
            together = self._measure([*self._items, item])
        if self._items and together > self._max_tokens:
            kept = self._group_cut(item) if tokens <= self._max_tokens else None
            if kept is None:
                closed.append(self._close())
                together = tokens
            else:
                closed.append(kept[0])
                together = kept[1]
        if tokens > self._max_tokens:
            closed.append(Batch((item,), tokens))
            return closed
        if not self._items:
            self._opened_at = self._clock()
        self._items.append(item)
        self._tokens = together
        if len(self._items) >= self._max_requests or self._tokens >= self._max_tokens:
            closed.append(self._close())
        return closed

    def _group_cut(self, item: T) -> tuple[Batch[T], int] | None:
        """When `item` does not fit the open batch and the last items share a prefix with it: the batch of
        the first items, closed, and what the ones left open compute with `item` (they stay open with it,
        models.plan.group_cut). None when the whole batch closes."""
        items, measure, joins = [*self._items, item], self._measure, self._joins
        if measure is None or joins is None:
            return None
        measured: dict[tuple[int, int], int] = {}

        def by_range(start: int, stop: int) -> int:
            if (start, stop) not in measured:
                measured[start, stop] = measure(items[start:stop])
            return measured[start, stop]

        last = len(self._items)
        cut = group_cut(0, last, lambda k, index: joins(items[k], items[index]), by_range, self._max_tokens)
        if cut == last:
            return None
        closing = Batch(tuple(items[:cut]), by_range(0, cut))
        self._items = items[cut:last]
        return closing, by_range(cut, last + 1)

    def due_in(self) -> float | None:
        """Seconds until the open batch must close (0 when overdue), or None when no batch is open."""
        if not self._items:
            return None
        return max(0.0, self._opened_at + self._max_wait_s - self._clock())

    def take_due(self) -> Batch[T] | None:
        """Close and return the open batch if its maximum wait has passed."""
        due = self.due_in()
        if due is None or due > 0:
            return None
        return self._close()

    def flush(self) -> Batch[T] | None:
        """Close and return the open batch whatever its age (at shutdown)."""
        return self._close() if self._items else None

    def _close(self) -> Batch[T]:
        batch = Batch(tuple(self._items), self._tokens)
        self._items = []
        self._tokens = 0
        return batch
