"""An ERROR line means something is wrong: a fresh cluster's missing group coordinator (its offsets topic is
being created) is logged at INFO, once, and only a coordinator that stays away past the grace is an error
again (worker/logs.py CoordinatorFilter, installed by the command line's logging)."""

from __future__ import annotations

import inspect
import io
import logging
from collections.abc import Iterator

import pytest
from aiokafka import errors

from worker.cli import configure_logging
from worker.logs import COORDINATOR_LOOKUPS, STILL_UNAVAILABLE, CoordinatorFilter

GROUP = "Group Coordinator Request failed: %s"


def _record(error: Exception, template: str = GROUP) -> logging.LogRecord:
    return logging.LogRecord(
        "aiokafka.consumer.group_coordinator", logging.ERROR, __file__, 1, template, (error,), None
    )


def test_the_templates_are_the_kafka_clients_own() -> None:
    from aiokafka.consumer import group_coordinator
    from aiokafka.producer import sender

    source = inspect.getsource(group_coordinator) + inspect.getsource(sender)
    for template in COORDINATOR_LOOKUPS:
        assert f'"{template}"' in source, f"aiokafka no longer logs {template!r}: the filter misses it"


def test_a_fresh_clusters_missing_coordinator_is_info_then_debug_then_an_error_past_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logging.getLogger(), "level", logging.DEBUG)
    now = [100.0]
    quiet = CoordinatorFilter(grace_s=30, gap_s=10, clock=lambda: now[0])
    first = _record(errors.GroupCoordinatorNotAvailableError())
    assert quiet.filter(first) and first.levelname == "INFO"
    now[0] += 0.1
    retry = _record(errors.GroupCoordinatorNotAvailableError())
    assert quiet.filter(retry) and retry.levelno == logging.DEBUG
    for _ in range(299):  # a retry every 0.1 s: still within the grace at 30 s
        now[0] += 0.1
        assert quiet.filter(record := _record(errors.CoordinatorLoadInProgressError()))
        assert record.levelno == logging.DEBUG
    now[0] += 0.2
    late = _record(errors.GroupCoordinatorNotAvailableError())
    assert quiet.filter(late) and late.levelno == logging.ERROR
    assert late.getMessage().endswith(STILL_UNAVAILABLE.format(30))


def test_a_coordinator_back_for_a_while_starts_a_new_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "level", logging.INFO)
    now = [0.0]
    quiet = CoordinatorFilter(grace_s=30, gap_s=10, clock=lambda: now[0])
    assert quiet.filter(_record(errors.GroupCoordinatorNotAvailableError()))
    now[0] += 0.1
    assert not quiet.filter(_record(errors.GroupCoordinatorNotAvailableError())), "DEBUG is not shown at INFO"
    now[0] += 60  # found in between; lost again, as when its broker restarts: a new short unavailability
    again = _record(errors.NotCoordinatorError())
    assert quiet.filter(again) and again.levelno == logging.INFO


def test_other_failures_stay_errors() -> None:
    quiet = CoordinatorFilter(clock=lambda: 0.0)
    refused = _record(errors.GroupAuthorizationFailedError())
    unreachable = _record(errors.KafkaConnectionError())
    other = logging.LogRecord("aiokafka", logging.ERROR, __file__, 1, "Heartbeat failed: %r", (1,), None)
    for record in (refused, unreachable, other):
        assert quiet.filter(record) and record.levelno == logging.ERROR


@pytest.fixture
def command_line_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """The command line's logging set-up, writing to a buffer; the root logger's handlers restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("aiokafka").level)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root.handlers = []
    configure_logging("INFO")
    yield stream
    root.handlers, root.level = saved[0], saved[1]
    logging.getLogger("aiokafka").setLevel(saved[2])


def test_the_command_lines_logging_shows_one_info_line_for_a_fresh_cluster(
    command_line_logging: io.StringIO,
) -> None:
    client = logging.getLogger("aiokafka.consumer.group_coordinator")
    for _ in range(20):
        client.error(GROUP, errors.GroupCoordinatorNotAvailableError())
    client.error("Heartbeat failed: %r", errors.KafkaConnectionError())
    lines = command_line_logging.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "INFO" in lines[0] and "GroupCoordinatorNotAvailableError" in lines[0]
    assert "ERROR" in lines[1] and "Heartbeat failed" in lines[1]
