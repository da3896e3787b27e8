"""Batches under load: while the model is busy, trickling requests fill one batch, not many small ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from worker_testkit import Names, WrappedScorer, client_kwargs, fast_settings, finish, request_record

from models import BatchObserver, PendingScores, Scorer, ScorerConfig
from schemas import ScoreRequest
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

FORWARD_S = 0.25  # a slow model: many requests arrive during one forward pass
REQUESTS = 60
GAP_S = 0.01  # one request every 10 ms: a trickle, as a Kafka broker delivers a steady stream


class SlowScorer(WrappedScorer):
    """The real Scorer with a forward pass made slow, recording the size of every batch it is given."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(Scorer(model_dir, ScorerConfig(device="cpu")))
        self.batch_sizes: list[int] = []

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        self.batch_sizes.append(len(prepared))
        time.sleep(FORWARD_S)
        return self.engine.launch(prepared, on_batch)


def test_requests_arriving_during_a_forward_join_one_batch(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("load")
    # A short fetch wait and max wait: each fetch brings one or two requests, and a batch would close
    # 2 ms after its first one if the batcher did not wait for the model thread to be free.
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_wait_ms=2, fetch_max_wait_ms=10, max_batch_requests=64
    )
    scorer = SlowScorer(tiny_llama_dir)
    requests = [ScoreRequest(request_id=f"load-{n}", items=((5, 6, 7, n + 8),)) for n in range(REQUESTS)]

    async def scenario() -> Any:
        await ensure_topics(settings)
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        producer = AIOKafkaProducer(**client_kwargs(kafka_bootstrap), acks="all")
        await producer.start()
        try:
            await asyncio.sleep(2 * settings.session_timeout_ms / 1000)  # let the worker join the group
            for request in requests:
                key, value, headers = request_record(request)
                await producer.send_and_wait(names.requests, value=value, key=key, headers=headers)
                await asyncio.sleep(GAP_S)
        finally:
            await producer.stop()
        return await finish(settings, [(worker, task)], REQUESTS, REQUESTS)

    outcome = asyncio.run(scenario())
    assert len(outcome.results) == REQUESTS
    assert sum(scorer.batch_sizes) == REQUESTS
    # About 0.25 s of arrivals (15-25 requests) gather during each forward; cutting a batch per fetch
    # instead gives dozens of batches of one or two requests that queue behind each other.
    assert len(scorer.batch_sizes) <= 12, scorer.batch_sizes
    assert max(scorer.batch_sizes) >= 10, scorer.batch_sizes
