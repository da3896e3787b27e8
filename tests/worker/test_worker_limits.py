"""Worker limits and failure paths against a real broker: backpressure, oversized results, a failing batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from worker_testkit import Names, committed_offsets, fast_settings, log_ends, produce, read_topic

from models import PreparedRequest, Scorer, ScorerConfig
from schemas import (
    ErrorCode,
    HiddenDType,
    ResultStatus,
    ScoreRequest,
    ScoreResult,
    decode_result,
    encode_request,
    request_headers,
)
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

MAX_INFLIGHT = 6


class ObservedScorer:
    """The real Scorer, plus: records the worker's in-flight count at each batch, fails batches on demand."""

    def __init__(self, scorer: Scorer, fail_request_id: str) -> None:
        self._scorer = scorer
        self._fail = fail_request_id
        self.worker: ScoreWorker | None = None
        self.in_flight_seen: list[int] = []
        self.batch_sizes: list[int] = []
        self.thread_names: set[str] = set()

    @property
    def model_name(self) -> str:
        return self._scorer.model_name

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        return self._scorer.prepare(request)

    def score_prepared(self, prepared: Sequence[Any]) -> list[ScoreResult]:
        assert self.worker is not None
        self.in_flight_seen.append(self.worker.in_flight)
        self.batch_sizes.append(len(prepared))
        self.thread_names.add(threading.current_thread().name)
        time.sleep(0.02)  # slower than fetching, so the worker runs into its in-flight limit
        if any(p.request.request_id == self._fail for p in prepared):
            raise RuntimeError("simulated kernel failure")
        return self._scorer.score_prepared(prepared)


def _requests() -> list[ScoreRequest]:
    requests = [ScoreRequest(request_id=f"lim-{i:03d}", items=(f"short text {i}",)) for i in range(40)]
    # 12 items x 64 float32 values = 3 KiB of hidden states: above the 2 KiB record limit below.
    requests.insert(
        10,
        ScoreRequest(
            request_id="too-large",
            items=tuple(f"item {j}" for j in range(12)),
            return_pooled_hidden_states=True,
            hidden_states_dtype=HiddenDType.FLOAT32,
        ),
    )
    requests.insert(25, ScoreRequest(request_id="explode", items=("this batch fails",)))
    return requests


def test_backpressure_oversized_results_and_failing_batches(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("limits")
    settings = fast_settings(
        kafka_bootstrap,
        tiny_llama_dir,
        names,
        max_inflight_requests=MAX_INFLIGHT,
        max_batch_requests=4,
        max_record_bytes=2048,
    )
    scorer = ObservedScorer(Scorer(tiny_llama_dir, ScorerConfig(device="cpu")), fail_request_id="explode")
    requests = _requests()
    records = [(r.request_id.encode(), encode_request(r), request_headers(r.request_id)) for r in requests]

    async def scenario() -> tuple[list[Any], list[Any], dict[int, int]]:
        await ensure_topics(settings)
        # All requests wait in the topic before the worker starts: only backpressure limits its fetching.
        await produce(kafka_bootstrap, names.requests, records)
        worker = ScoreWorker(settings, scorer)
        scorer.worker = worker
        task = asyncio.create_task(worker.run())
        results = await read_topic(kafka_bootstrap, names.results, len(requests), timeout_s=120)
        worker.stop()
        await asyncio.wait_for(task, timeout=60)
        sources = await read_topic(kafka_bootstrap, names.requests, len(requests), settle_s=0.2)
        return results, sources, await committed_offsets(kafka_bootstrap, names.group, names.requests)

    results, sources, committed = asyncio.run(scenario())

    by_id = {decode_result(r.value).request_id: decode_result(r.value) for r in results}
    assert len(results) == len(by_id) == len(requests)
    assert max(scorer.in_flight_seen) == MAX_INFLIGHT  # reached, never exceeded
    assert max(scorer.batch_sizes) <= 4
    assert len(scorer.thread_names) == 1 and next(iter(scorer.thread_names)).startswith("score-model")

    too_large = by_id["too-large"]
    assert too_large.status == ResultStatus.ERROR and too_large.error is not None
    assert (
        too_large.error.code == ErrorCode.RESULT_TOO_LARGE and "max_record_bytes" in too_large.error.message
    )
    failed = [r for r in by_id.values() if r.error is not None and r.error.code == ErrorCode.INTERNAL_ERROR]
    assert "explode" in {r.request_id for r in failed}
    assert 1 <= len(failed) <= 4  # only the failing batch
    assert all(r.status == ResultStatus.OK for r in by_id.values() if r not in failed and r is not too_large)
    assert committed == log_ends(sources)
