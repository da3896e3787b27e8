"""A second worker joins mid-stream: the first finishes and commits what it holds on revocation."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from worker_testkit import Names, committed_offsets, fast_settings, log_ends, produce, read_topic

from models import Scorer, ScorerConfig
from schemas import ResultStatus, ScoreRequest, ScoreResult, decode_result, encode_request, request_headers
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

TOTAL = 160


def _count_calls(scorer: Scorer, counts: dict[str, int], name: str) -> None:
    score_prepared = scorer.score_prepared

    def counting(prepared: Sequence[Any]) -> list[ScoreResult]:
        counts[name] += len(prepared)
        return score_prepared(prepared)

    scorer.score_prepared = counting  # type: ignore[method-assign]


def test_partitions_move_to_a_joining_worker_without_loss_or_duplicates(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("rebalance")
    # A small in-flight limit leaves most requests in the topic when the second worker joins.
    settings = fast_settings(
        kafka_bootstrap,
        tiny_llama_dir,
        names,
        max_inflight_requests=16,
        max_batch_requests=8,
        topic_partitions=4,
    )
    scorer_a = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    scorer_b = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    scored = {"first": 0, "second": 0}
    _count_calls(scorer_a, scored, "first")
    _count_calls(scorer_b, scored, "second")
    requests = [
        ScoreRequest(request_id=f"rb-{i:04d}", items=(f"text number {i}", "second")) for i in range(TOTAL)
    ]
    records = [(r.request_id.encode(), encode_request(r), request_headers(r.request_id)) for r in requests]

    async def scenario() -> tuple[list, list, dict[int, int]]:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, records)
        first = ScoreWorker(settings, scorer_a)
        first_task = asyncio.create_task(first.run())
        await read_topic(kafka_bootstrap, names.results, 16, timeout_s=120, settle_s=0)  # first is busy
        second = ScoreWorker(settings, scorer_b)
        second_task = asyncio.create_task(second.run())
        results = await read_topic(kafka_bootstrap, names.results, TOTAL, timeout_s=180, settle_s=2.0)
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(first_task, second_task), timeout=60)
        sources = await read_topic(kafka_bootstrap, names.requests, TOTAL, settle_s=0.2)
        return results, sources, await committed_offsets(kafka_bootstrap, names.group, names.requests)

    results, sources, committed = asyncio.run(scenario())
    decoded = [decode_result(r.value) for r in results]
    counts = Counter(r.request_id for r in decoded)
    assert sorted(counts) == sorted(r.request_id for r in requests)
    assert set(counts.values()) == {1}, {rid: n for rid, n in counts.items() if n > 1}
    assert all(r.status == ResultStatus.OK for r in decoded)
    assert committed == log_ends(sources)
    # Both workers scored, and no request was scored twice (not even work lost at the revocation).
    assert scored["first"] > 0 and scored["second"] > 0
    assert scored["first"] + scored["second"] == TOTAL
