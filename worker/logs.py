"""Quiet outages: a message the Kafka client repeats on every reconnect attempt is logged once per minute."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# How long repeats of one message stay quiet after it was logged (seconds).
REPEAT_WINDOW_S = 60.0
# Logged by the worker on every pause and resume of fetching: under sustained load several times a second.
PAUSING = "pausing fetches: %d requests in flight (max_inflight_requests %d)"
RESUMING = "resuming fetches: %d requests in flight"


class RepeatFilter(logging.Filter):
    """Lets the first record of each (logger, message template) through, holds back repeats for
    `window_s`, and then lets the next one through with the number held back since.

    A 45 s broker outage otherwise writes thousands of identical lines ("Unable connect to node ...").
    Only records from loggers under `prefixes`, and records with one of the message `templates`, are
    filtered; everything else passes (an assignment must never be held back as a repeat).
    """

    def __init__(
        self,
        prefixes: tuple[str, ...] = ("aiokafka",),
        templates: frozenset[str] = frozenset(),
        window_s: float = REPEAT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._prefixes = prefixes
        self._templates = templates
        self._window_s = window_s
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last logged, held back)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefixes) and record.msg not in self._templates:
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        logged_at, held = self._seen.get(key, (None, 0))
        if logged_at is not None and now - logged_at < self._window_s:
            self._seen[key] = (logged_at, held + 1)
            return False
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {now - logged_at:.0f} s)"  # type: ignore[operator]
        if len(self._seen) > 1000:  # messages with changing templates must not grow this without bound
            self._seen.clear()
        return True


# How long a coordinator may stay unavailable before the Kafka client's complaint is an error: a new
# cluster creates its offsets and transaction topics on the first group or transactional producer, and
# elects their leaders, in seconds; a coordinator that stays away longer is a fault.
COORDINATOR_GRACE_S = 30.0
# Records further apart than this belong to separate unavailabilities (the client retries every 0.1 s).
COORDINATOR_STREAK_GAP_S = 10.0
# What the Kafka client logs, at ERROR, on each failed coordinator lookup: the group's, the producer's.
COORDINATOR_LOOKUPS = frozenset(
    {"Group Coordinator Request failed: %s", "FindCoordinator Request failed: %s"}
)
STILL_UNAVAILABLE = " (no coordinator for over {:.0f} s)"


class CoordinatorFilter(logging.Filter):
    """The Kafka client logs ERROR on every failed coordinator lookup, the normal state of a fresh cluster
    for its first seconds (GroupCoordinatorNotAvailableError while the offsets topic is created). Within
    `grace_s` of the first failure of a run of them, the first is logged at INFO and the rest at DEBUG;
    past it they are errors again, saying for how long (the repeat filter then keeps them to one a minute).
    Other records and other errors pass as they are."""

    def __init__(
        self,
        grace_s: float = COORDINATOR_GRACE_S,
        gap_s: float = COORDINATOR_STREAK_GAP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._grace_s = grace_s
        self._gap_s = gap_s
        self._clock = clock
        self._streaks: dict[str, tuple[float, float]] = {}  # template -> (first failure, last failure)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in COORDINATOR_LOOKUPS or not _coordinator_unavailable(record.args):
            return True
        now = self._clock()
        first, last = self._streaks.get(str(record.msg), (now, now))
        if now - last > self._gap_s:
            first = now
        self._streaks[str(record.msg)] = (first, now)
        if now - first > self._grace_s:
            record.msg = str(record.msg) + STILL_UNAVAILABLE.format(self._grace_s)
            return True
        level = logging.INFO if now == first else logging.DEBUG
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return level >= logging.getLogger().getEffectiveLevel()


def _coordinator_unavailable(args: object) -> bool:
    """Whether a lookup's failure is the coordinator not being there yet (rather than refused access)."""
    from aiokafka import errors

    transient = (
        errors.CoordinatorNotAvailableError,
        errors.CoordinatorLoadInProgressError,
        errors.NotCoordinatorError,
    )
    return isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], transient)
