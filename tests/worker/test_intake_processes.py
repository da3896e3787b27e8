"""Intake processes: records decoded and tokenised in processes of their own come out exactly as on the
worker's thread, every record the processes cannot take is prepared on that thread instead, and processes
that die or hang lose nothing and are started again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka.structs import ConsumerRecord
from tolerances import assert_scored_alike
from worker_testkit import Names, fast_settings, finish, produce, request_record

import worker.intake_processes as intake_processes
from models import Scorer, ScorerConfig
from schemas import (
    HEADER_REPLY_TOPIC,
    ErrorCode,
    ScoreRequest,
    decode_result,
    encode_request,
    request_headers,
)
from worker.app import ScoreWorker
from worker.intake import Accepted, Intake, Rejected
from worker.intake_processes import IntakeProcesses, process_count
from worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(300)


def _record(offset: int, value: bytes, timestamp_ms: int | None = None, headers: Any = ()) -> Any:
    now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    return ConsumerRecord(
        "requests", 0, offset, now, 0, f"k{offset}".encode(), value, None, len(value), -1, list(headers)
    )


def _records() -> tuple[list[Any], list[bool]]:
    """A mix of records, and whether the processes should prepare each (the rest is the thread's)."""
    hour_ago = int(time.time() * 1000) - 3_600_000
    cases: list[tuple[bytes, dict[str, Any], bool]] = [
        (
            encode_request(ScoreRequest("ids", items=((5, 6, 7), (8, 9)), return_pooled_hidden_states=True)),
            {},
            True,
        ),
        (encode_request(ScoreRequest("text", query="which is right?", items=("this one", "that"))), {}, True),
        (b"\xc1 not msgpack", {}, False),
        (encode_request(ScoreRequest("out-of-vocabulary", items=((5, 10**9),))), {}, False),
        (encode_request(ScoreRequest("empty-item", items=((),))), {}, False),
        # Prepared there, answered here: expired since its record was written, a refused reply topic.
        (
            encode_request(ScoreRequest("expired", items=((5, 6),), ttl_ms=1000)),
            {"timestamp_ms": hour_ago},
            True,
        ),
        (
            encode_request(ScoreRequest("bad-reply-topic", items=((5, 6),))),
            {"headers": [(HEADER_REPLY_TOPIC, b"no spaces allowed")]},
            True,
        ),
        # Too large for the record limit with its hidden states: refused before any model time.
        (
            encode_request(ScoreRequest("too-large", items=((5,),) * 300, return_pooled_hidden_states=True)),
            {},
            True,
        ),
    ]
    records = [_record(i, value, **extra) for i, (value, extra, _) in enumerate(cases)]
    return records, [expected for _, _, expected in cases]


async def _started(scorer: Scorer, processes: int = 1, **callbacks: Any) -> IntakeProcesses:
    pool = IntakeProcesses(scorer.prompt_builder, processes, **callbacks)
    pool.start()
    await _until(lambda: pool.ready)
    return pool


async def _until(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    """Polls: the processes take seconds to import their libraries and signal nothing on the way."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def _pids(pool: IntakeProcesses) -> list[int]:
    return list(pool._executor._processes)  # type: ignore[union-attr]


def _answers(outcome: Accepted | Rejected) -> list[tuple[Any, ...]]:
    if isinstance(outcome, Accepted):
        prepared = outcome.prepared
        return [
            (outcome.tp, outcome.offset, outcome.key, outcome.request, outcome.expires_at_ms, outcome.route),
            (prepared.prompts, prepared.token_types, prepared.truncated),
        ]
    results = [decode_result(m.value) if m.result is not None else None for m in outcome.messages]
    return [
        (outcome.tp, outcome.offset, [(m.topic, m.key, m.dead_letter_reason) for m in outcome.messages]),
        *((r.request_id, r.status, r.error and r.error.code, r.metadata) for r in results if r is not None),
    ]


def test_records_prepared_in_processes_equal_those_prepared_on_the_thread(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    settings = fast_settings(
        "localhost:1", tiny_llama_dir, Names.unique("intake"), max_record_bytes=64 * 1024
    )
    intake = Intake(settings, scorer, WorkerMetrics("intake-test"))
    records, expected = _records()
    counted: list[int] = []

    async def scenario() -> list[Any]:
        pool = await _started(scorer, 2, on_prepared=counted.append)
        try:
            prepared = await pool.prepare([record.value for record in records])
            # Decoding and tokenising need no torch: a process that loaded it would spend seconds of CPU and
            # hundreds of megabytes on it, every start and restart.
            for pid in _pids(pool):
                assert "libtorch" not in _mapped_files(pid), pid
            return prepared
        finally:
            pool.close()

    ready = asyncio.run(scenario())
    assert [r is not None for r in ready] == expected
    assert sum(counted) == sum(expected)
    for done in ready:
        if done is not None:
            alone = scorer.prepare(done[0].request)
            assert (done[0].prompts, done[0].token_types) == (alone.prompts, alone.token_types)
            assert done[1] > 0
    here = intake.prepare_all(records)
    there = intake.prepare_all(records, ready)
    assert [_answers(o) for o in there] == [_answers(o) for o in here]
    answers = [None if isinstance(o, Accepted) else _answers(o)[1:] for o in there]
    codes = [a[0][2] if a else None for a in answers]
    assert codes == [
        None, None, None, ErrorCode.TOKEN_ID_OUT_OF_RANGE, ErrorCode.EMPTY_INPUT,
        ErrorCode.EXPIRED, ErrorCode.REPLY_TOPIC_NOT_ALLOWED, ErrorCode.RESULT_TOO_LARGE,
    ]  # fmt: skip
    malformed = there[2]
    assert isinstance(malformed, Rejected) and malformed.messages[0].dead_letter_reason is not None


def _mapped_files(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _values(count: int) -> list[bytes]:
    return [encode_request(ScoreRequest(f"r{i}", items=((5, 6, 7 + i),))) for i in range(count)]


def test_a_killed_process_loses_no_record_and_the_processes_start_again(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    restarts: list[None] = []

    async def scenario() -> None:
        pool = await _started(scorer, 1, on_restart=lambda: restarts.append(None))
        try:
            for pid in _pids(pool):
                os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            # The call that finds the pool broken hands every record back, to be prepared on the thread.
            assert await pool.prepare(_values(20)) == [None] * 20
            assert (pool.restarts, len(restarts)) == (1, 1)
            await _until(lambda: pool.ready)
            again = await pool.prepare(_values(20))
            assert all(done is not None for done in again)
        finally:
            pool.close()

    asyncio.run(scenario())


def _dead(pid: int, timeout_s: float) -> bool:
    """Whether the process `pid` ends within `timeout_s`: gone, or a zombie. Read from /proc, not from its
    Process object: the pool's own management thread may reap it first, and the exit code is then lost to
    this one. A stopped process can only end by SIGKILL (other signals wait for it to continue)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_hung_process_is_killed_and_its_records_handed_back(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intake_processes, "CALL_TIMEOUT_S", 0.5)
    monkeypatch.setattr(intake_processes, "CALL_TIMEOUT_PER_RECORD_S", 0.0)
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))

    async def scenario() -> None:
        pool = await _started(scorer, 1)
        hung = list(pool._executor._processes.values())  # type: ignore[union-attr]
        try:
            for process in hung:
                os.kill(process.pid, signal.SIGSTOP)  # alive, never answering
            started = time.monotonic()
            assert await pool.prepare(_values(5)) == [None] * 5
            assert time.monotonic() - started < 5
            for process in hung:
                assert _dead(process.pid, 10), f"the stopped process {process.pid} is still there"
            assert pool.restarts == 1
        finally:
            pool.close()

    asyncio.run(scenario())


def test_after_repeated_failures_the_thread_prepares_for_good(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intake_processes, "MAX_RESTARTS", 0)
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))

    async def scenario() -> None:
        pool = await _started(scorer, 1)
        for pid in _pids(pool):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        assert await pool.prepare(_values(3)) == [None] * 3
        await asyncio.sleep(1.0)
        assert not pool.ready and pool._executor is None
        assert await pool.prepare(_values(3)) == [None] * 3

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("setting", "device", "count"), [(None, "cuda:0", 2), (None, "cpu", 0), (3, "cpu", 3)]
)
def test_intake_processes_by_default_only_beside_a_gpu(setting: int | None, device: str, count: int) -> None:
    assert process_count(setting, device) == count


def _processes_ready(worker: ScoreWorker) -> bool:
    return worker.intake_processes is not None and worker.intake_processes.ready


def _scores(results: Sequence[Any]) -> dict[str, Any]:
    return {r.request_id: r for r in results}


def test_a_worker_with_intake_processes_answers_every_record_as_one_without(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("intake-worker")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, intake_processes=1, max_wait_ms=50)
    rng = np.random.default_rng(3)
    requests = [
        ScoreRequest(f"w{i}", items=tuple(tuple(rng.integers(5, 200, 20).tolist()) for _ in range(2)))
        for i in range(40)
    ]
    records = [request_record(r) for r in requests]
    # Not a request: the process hands it back and the worker's own thread answers it.
    records.append((b"broken", b"\xc1 not msgpack", request_headers("broken")))

    async def scenario() -> Any:
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        await _until(lambda: _processes_ready(worker))
        await produce(kafka_bootstrap, names.requests, records)
        outcome = await finish(settings, [(worker, task)], len(records), len(records))
        return outcome, worker.metrics

    outcome, metrics = asyncio.run(scenario())
    results = [decode_result(r.value or b"") for r in outcome.results]
    assert len(results) == len(records)
    errors = [r for r in results if not r.ok]
    assert [r.error.code for r in errors if r.error] == [ErrorCode.MALFORMED_MESSAGE]
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    got = _scores(results)
    for request, expected in zip(requests, scorer.score(requests), strict=True):
        assert_scored_alike(got[expected.request_id], expected, scorer, [request])
    labels = {"model": tiny_llama_dir.name, "worker": settings.worker_id}
    # A fetch of a few records while the model idles is prepared on the worker's thread (quicker than a
    # round trip to a process), so how many of the 40 go through the process depends on how the broker's
    # fetches split them; that some did, and none more than once, does not.
    in_process = metrics.registry.get_sample_value("score_worker_intake_process_requests_total", labels)
    assert in_process is not None and 0 < in_process <= 40
    assert metrics.registry.get_sample_value("score_worker_intake_process_restarts_total", labels) == 0
