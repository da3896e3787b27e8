"""Rebalances: the worker losing partitions finishes and commits what it holds, so nothing is scored twice."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from brokers import broker_tiers
from worker_testkit import (
    Names,
    Outcome,
    WrappedScorer,
    fast_settings,
    finish,
    log_ends,
    produce,
    read_topic,
    request_record,
)

from models import BatchObserver, PendingScores, PreparedRequest, Scorer, ScorerConfig
from schemas import ResultStatus, ScoreRequest, ScoreResult, decode_result
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

# Group coordination is the broker's: both Kafka versions (3.9's coordinator and 4.x's rewrite).
kafka_bootstrap = broker_tiers("default", "kafka-compose")

TOTAL = 160
GATE = "gate"


class CountingScorer(WrappedScorer):
    """The real Scorer, counting what it scores; preparing request GATE waits until `release` is set."""

    def __init__(self, model_dir: Path, delay_s: float = 0.0) -> None:
        super().__init__(Scorer(model_dir, ScorerConfig(device="cpu")))
        self._delay_s = delay_s
        self.scored: Counter[str] = Counter()
        self.gate_entered = threading.Event()
        self.release = threading.Event()

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        if request.request_id == GATE:
            self.gate_entered.set()
            self.release.wait(60)
        return self.engine.prepare(request)

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        self.scored.update(p.request.request_id for p in prepared)
        time.sleep(self._delay_s)
        return self.engine.launch(prepared, on_batch)


def _check_once_each(outcome: Outcome, requests: list[ScoreRequest], scorers: list[CountingScorer]) -> None:
    """One result per request, none scored twice, and everything committed."""
    scored = sum((scorer.scored for scorer in scorers), Counter[str]())
    decoded = [decode_result(r.value) for r in outcome.results]
    counts = Counter(r.request_id for r in decoded)
    assert sorted(counts) == sorted(r.request_id for r in requests)
    assert set(counts.values()) == {1}, {rid: n for rid, n in counts.items() if n > 1}
    assert all(r.status == ResultStatus.OK for r in decoded)
    # Not even work cut off by the revocation was scored a second time.
    assert sorted(scored) == sorted(r.request_id for r in requests)
    assert set(scored.values()) == {1}, {rid: n for rid, n in scored.items() if n > 1}
    assert outcome.committed == log_ends(outcome.sources)


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
    # Paced like a larger model (20 batches of 0.1 s), so the stream outlasts the second worker's join.
    scorers = [CountingScorer(tiny_llama_dir, delay_s=0.1) for _ in range(2)]
    requests = [
        ScoreRequest(request_id=f"rb-{i:04d}", items=(f"text number {i}", "second")) for i in range(TOTAL)
    ]

    async def scenario() -> Outcome:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        first = ScoreWorker(settings, scorers[0])
        first_task = asyncio.create_task(first.run())
        await read_topic(kafka_bootstrap, names.results, 16, timeout_s=120, settle_s=0)  # first is busy
        second = ScoreWorker(settings, scorers[1])
        workers = [(first, first_task), (second, asyncio.create_task(second.run()))]
        return await finish(settings, workers, TOTAL, TOTAL)

    outcome = asyncio.run(scenario())
    assert all(scorer.scored for scorer in scorers)  # the second worker joined mid-stream and took a share
    _check_once_each(outcome, requests, scorers)


def test_revocation_while_requests_are_being_tokenised_finishes_them(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    """The revocation lands while fetched requests are still being prepared (off the loop), and outlasts
    the session timeout: it must still wait for them, publish them, and commit them before letting go."""
    names = Names.unique("revoke-prepare")
    # max_poll_interval bounds the wait at revocation (10 s here): far above what the work needs.
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, topic_partitions=2, max_poll_interval_ms=20_000
    )
    first_scorer, second_scorer = CountingScorer(tiny_llama_dir), CountingScorer(tiny_llama_dir)
    second_scorer.release.set()
    requests = [ScoreRequest(request_id=GATE, items=("held back",))]
    requests += [ScoreRequest(request_id=f"rp-{i:02d}", items=(f"text {i}",)) for i in range(20)]
    revocations: list[float] = []
    revoking = asyncio.Event()

    async def scenario() -> Outcome:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        first = ScoreWorker(settings, first_scorer)
        revoke = first._on_revoked

        async def timed_revoke(revoked: set[Any]) -> None:
            if revoked:
                revoking.set()
            started = time.monotonic()
            await revoke(revoked)
            if revoked:
                revocations.append(time.monotonic() - started)

        first._on_revoked = timed_revoke  # type: ignore[method-assign]
        first_task = asyncio.create_task(first.run())
        assert await asyncio.to_thread(first_scorer.gate_entered.wait, 60)  # everything fetched, preparing
        second = ScoreWorker(settings, second_scorer)
        workers = [(first, first_task), (second, asyncio.create_task(second.run()))]
        await asyncio.wait_for(revoking.wait(), timeout=30)
        # Keep the fetched requests unprepared past the session timeout (aiokafka's default rebalance
        # timeout): the group must keep waiting for this member instead of handing its partitions on.
        await asyncio.sleep(settings.session_timeout_ms / 1000 * 1.5)
        first_scorer.release.set()
        return await finish(settings, workers, len(requests), len(requests))

    outcome = asyncio.run(scenario())
    assert revocations and revocations[0] < 6.0, revocations  # finished with the work, not at its limit
    _check_once_each(outcome, requests, [first_scorer, second_scorer])
