"""SIGTERM while requests are in flight: the worker publishes them, commits, exits 0; a successor finishes."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from worker_testkit import (
    Names,
    Outcome,
    committed_offsets,
    fast_settings,
    finish,
    log_ends,
    produce,
    read_topic,
    request_record,
)

from models import Scorer, ScorerConfig
from schemas import ResultStatus, ScoreRequest, decode_result
from worker.app import ScoreWorker
from worker.config import WorkerSettings
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

TOTAL = 100
MAX_INFLIGHT = 40  # below TOTAL: the first worker cannot fetch everything before it is stopped
# The first worker holds what it fetched in an open batch for this long: the window in which SIGTERM
# lands with requests certainly in flight (fetched, not yet published).
HOLD_MS = 4000


def _requests() -> list[ScoreRequest]:
    return [
        ScoreRequest(
            request_id=f"sd-{i:04d}",
            query="a question about foxes and dogs",
            items=tuple(f"candidate answer {i} number {j} jumps over the lazy dog" for j in range(2)),
            return_pooled_hidden_states=i % 2 == 0,
        )
        for i in range(TOTAL)
    ]


def _worker_command(settings: WorkerSettings) -> list[str]:
    return [
        sys.executable, "-m", "worker", "--log-level", "DEBUG", "run",
        "--model", str(settings.model_dir),
        "--bootstrap-servers", settings.bootstrap_servers,
        "--requests-topic", settings.requests_topic,
        "--results-topic", settings.results_topic,
        "--dlq-topic", settings.dlq_topic,
        "--group-id", settings.group_id,
        "--device", "cpu",
        "--session-timeout-ms", str(settings.session_timeout_ms),
        "--heartbeat-interval-ms", str(settings.heartbeat_interval_ms),
        "--max-batch-requests", "64",
        "--max-batch-tokens", "100000",
        "--max-wait-ms", str(HOLD_MS),
        "--max-inflight-requests", str(MAX_INFLIGHT),
        "--commit-interval-ms", "60000",  # only the commit at shutdown counts: it is what is tested
        "--no-create-topics",
    ]  # fmt: skip


def _wait_for_log(path: Path, pattern: str, process: subprocess.Popen[bytes], timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, path.read_text(errors="replace"))
        if found:
            return found.group(0)
        assert process.poll() is None, "the worker exited early:\n" + path.read_text(errors="replace")
        assert time.monotonic() < deadline, "the worker fetched nothing:\n" + path.read_text(errors="replace")
        time.sleep(0.05)


def test_sigterm_drains_in_flight_work_and_a_successor_finishes(
    kafka_bootstrap: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    names = Names.unique("shutdown")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names)
    requests = _requests()
    asyncio.run(ensure_topics(settings))
    asyncio.run(produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests]))

    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(_worker_command(settings), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_for_log(log_path, r"fetched \d+ records", process)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    log_text = log_path.read_text()
    assert code == 0, log_text
    in_flight = re.search(r"stop requested: (\d+) fetched requests in flight", log_text)
    assert in_flight is not None, log_text
    assert int(in_flight.group(1)) > 0, "SIGTERM came when nothing was in flight: the test proves nothing"
    assert "worker stopped" in log_text

    # Everything that was in flight was published before the exit, and exactly that was committed.
    first_results = asyncio.run(read_topic(kafka_bootstrap, names.results, 1, settle_s=0.5))
    assert len(first_results) == int(in_flight.group(1)) < TOTAL
    first_committed = asyncio.run(committed_offsets(kafka_bootstrap, names.group, names.requests))
    assert sum(first_committed.values()) == len(first_results)
    outcome = asyncio.run(_finish_with_successor(settings))
    results = outcome.results
    counts = Counter(decode_result(r.value).request_id for r in results)
    assert sorted(counts) == sorted(r.request_id for r in requests)  # nothing lost
    assert set(counts.values()) == {1}  # nothing duplicated
    assert all(decode_result(r.value).status == ResultStatus.OK for r in results)
    assert outcome.committed == log_ends(outcome.sources)


async def _finish_with_successor(settings: WorkerSettings) -> Outcome:
    worker = ScoreWorker(settings, Scorer(settings.model_dir, ScorerConfig(device="cpu")))
    return await finish(settings, [(worker, asyncio.create_task(worker.run()))], TOTAL, TOTAL)
