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
