"""The worker's bounds in isolation: quiet repeated logs, the watchdog's limit, publish fallbacks, threads."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError
from worker_testkit import Names, fast_settings

from models import Scorer, ScorerConfig
from schemas import ErrorCode, ScoreResult, decode_result
from worker import publisher, topics
from worker.app import ScoreWorker
from worker.cli import torch_threads
from worker.logs import PAUSING, RESUMING, RepeatFilter
from worker.pipeline import Watchdog
from worker.publisher import _smaller, result_record
from worker.replies import Route


def _record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)


def test_repeated_client_errors_are_logged_once_per_window_with_a_count() -> None:
    now = [0.0]
    quiet = RepeatFilter(window_s=60, clock=lambda: now[0])
    first = _record("aiokafka.conn", "Unable connect to node with id 1")
    assert quiet.filter(first)
    for second in range(1, 45):  # a 45 s outage, one attempt a second
        now[0] = second
        assert not quiet.filter(_record("aiokafka.conn", "Unable connect to node with id 1"))
    assert quiet.filter(_record("aiokafka.cluster", "Unable to update metadata"))  # another message
    assert quiet.filter(_record("worker.sink", "Unable connect to node with id 1"))  # not the client's
    for _ in range(3):  # the worker's own lines pass, however often: an assignment is never a repeat
        assert quiet.filter(_record("worker.source", "assigned partitions: %s"))
    now[0] = 61
    later = _record("aiokafka.conn", "Unable connect to node with id 1")
    assert quiet.filter(later)
    assert "and 44 more like it in the last 61 s" in later.getMessage()


def test_pause_and_resume_lines_are_held_back_like_client_errors() -> None:
    quiet = RepeatFilter(templates=frozenset({PAUSING, RESUMING}), clock=lambda: 0.0)
    assert quiet.filter(_record("worker.source", PAUSING))
    assert not quiet.filter(_record("worker.source", PAUSING))
    assert quiet.filter(_record("worker.source", RESUMING))
    assert quiet.filter(_record("worker.source", "revoking partitions: %s"))
    assert quiet.filter(_record("worker.source", "revoking partitions: %s"))


def test_the_watchdog_allows_a_multiple_of_the_expected_time_never_less_than_its_floor() -> None:
    watchdog = Watchdog(floor_s=2.0, multiple=10.0)
    assert watchdog.limit_s(10_000) == 2.0  # nothing measured yet: the floor
    watchdog.observe(1000, 0.5)  # 0.5 ms per token
    assert watchdog.limit_s(1000) == 5.0
    assert watchdog.limit_s(100) == 2.0
    assert Watchdog(floor_s=0, multiple=10).limit_s(10) is None  # off


def test_a_record_the_broker_refuses_as_too_large_is_sent_in_its_smallest_form(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    settings = fast_settings("127.0.0.1:9092", tiny_llama_dir, Names.unique("units"), max_record_bytes=8192)
    result = ScoreResult("r1", "ok", scores=((0.5,),), metadata={"note": "n" * 3000}, model="m")
    record = result_record(settings, b"r1", result)
    assert record.result is result and record.fallback() is not None
    smaller = _smaller(record, MessageSizeTooLargeError())
    assert smaller is record.fallback()
    answer = decode_result(smaller.value or b"")
    assert answer.error is not None and answer.error.code is ErrorCode.RESULT_TOO_LARGE
    assert _smaller(record, KafkaConnectionError()) is record  # other errors: retried as it is
    assert _smaller(smaller, MessageSizeTooLargeError()) is None  # nothing smaller: dropped, logged


def test_a_result_that_fits_is_encoded_once_and_its_smaller_forms_only_when_refused(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch's results are encoded between two forward passes: the error forms that stand in for a result
    # the broker refuses must cost nothing until then.
    settings = fast_settings("127.0.0.1:9092", tiny_llama_dir, Names.unique("units"), max_record_bytes=8192)
    encoded: list[str] = []
    real = publisher.encode_result
    monkeypatch.setattr(publisher, "encode_result", lambda r: encoded.append(r.status.value) or real(r))
    record = result_record(settings, b"r1", ScoreResult("r1", "ok", scores=((0.5,),), model="m"))
    assert encoded == ["ok"]
    smallest = record.fallback()
    assert smallest is not None and smallest is record.fallback()  # built once, when first asked for
    assert encoded == ["ok", "error", "error"] and smallest.key is None
    # A result for a reply topic: the error result that replaces it if that topic is missing, likewise.
    encoded.clear()
    routed = result_record(
        settings, b"r2", ScoreResult("r2", "ok", scores=((0.5,),), model="m"), Route("score.results.me")
    )
    assert encoded == ["ok"] and routed.make_if_topic_missing is not None
    instead = routed.make_if_topic_missing()
    assert instead is routed.make_if_topic_missing() and instead.topic == settings.results_topic
    answer = decode_result(instead.value or b"")
    assert answer.error is not None and answer.error.code is ErrorCode.REPLY_TOPIC_NOT_ALLOWED
    assert encoded == ["ok", "error"]


@pytest.mark.parametrize(("device", "setting", "expected"), [("cuda", 0, 2), ("cpu", 3, 3), ("cuda", 5, 5)])
def test_torch_threads_default_per_device(
    device: str, setting: int, expected: int, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    names = Names.unique("threads")
    settings = fast_settings("127.0.0.1:9092", tiny_llama_dir, names, device=device, torch_threads=setting)
    assert torch_threads(settings) == expected


def test_torch_threads_on_cpu_follow_the_cpus_this_process_may_use(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    settings = fast_settings("127.0.0.1:9092", tiny_llama_dir, Names.unique("threads"))
    assert torch_threads(settings) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_threads_take_omp_num_threads_where_set_and_the_setting_over_it(
    device: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    names = Names.unique("threads")
    assert torch_threads(fast_settings("127.0.0.1:9092", tiny_llama_dir, names, device=device)) == 3
    explicit = fast_settings("127.0.0.1:9092", tiny_llama_dir, names, device=device, torch_threads=5)
    assert torch_threads(explicit) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert torch_threads(fast_settings("127.0.0.1:9092", tiny_llama_dir, names, device="cpu")) == len(
        os.sched_getaffinity(0)
    )


class _FakeAdmin:
    """Answers DescribeConfigs like Kafka: per topic (error code, message, type, name, entries)."""

    limits: ClassVar[dict[str, int]] = {}

    def __init__(self, **kwargs: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        answers = [
            (0, None, 2, r.name, [("max.message.bytes", str(self.limits[r.name]), False, False, False)])
            for r in resources
        ]
        return [SimpleNamespace(resources=answers)]


def test_the_brokers_record_limit_lowers_the_workers_own(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = Names.unique("recordlimit")
    settings = fast_settings(
        "127.0.0.1:9092", tiny_llama_dir, names, max_record_bytes=1_048_576, create_topics=False
    )
    _FakeAdmin.limits = {names.results: 500_000, names.dlq: 1_000_000}
    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _FakeAdmin)
    assert asyncio.run(topics.broker_record_limit(settings)) == 500_000
    worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
    effective = asyncio.run(worker._effective_settings())
    assert effective.max_record_bytes == 500_000

    class _Silent(_FakeAdmin):
        async def describe_configs(self, resources: list[Any]) -> list[Any]:
            raise KafkaConnectionError("Connection closed")  # what Tansu does

    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _Silent)
    assert asyncio.run(topics.broker_record_limit(settings)) is None
    assert asyncio.run(worker._effective_settings()).max_record_bytes == 1_048_576


def test_misspelt_variables_are_named() -> None:
    from worker.environment import unknown_variables

    environ = {
        "SCORE_WORKER_MAX_BATCH_TOKEN": "1",  # misspelt
        "SCORE_WORKER_MAX_BATCH_TOKENS": "1",
        "SCORE_WORKER_LOG_LEVEL": "DEBUG",
        "SCORE_WORKER_SASL_PASSWORD": "x",
        "OTHER": "1",
    }
    assert unknown_variables(environ) == ["SCORE_WORKER_MAX_BATCH_TOKEN"]
