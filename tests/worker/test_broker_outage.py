"""The broker goes away: stopping the worker still returns promptly instead of retrying a commit forever."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from brokers import OwnBroker
from worker_testkit import Names, fast_settings, produce, read_topic, request_record

from models import Scorer, ScorerConfig
from schemas import ScoreRequest
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow


def test_stop_returns_when_the_broker_is_gone(
    tiny_llama_dir: Path, own_broker: Callable[..., OwnBroker]
) -> None:
    requests = [ScoreRequest(request_id=f"out-{i}", items=(f"text {i}",)) for i in range(8)]
    names = Names.unique("outage")

    async def scenario(broker: OwnBroker) -> float:
        bootstrap = broker.bootstrap_servers
        # No periodic commit: the final one, at stop, is the one that meets the outage.
        settings = fast_settings(bootstrap, tiny_llama_dir, names, commit_interval_ms=600_000)
        await ensure_topics(settings)
        await produce(bootstrap, names.requests, [request_record(r) for r in requests])
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        await read_topic(bootstrap, names.results, len(requests), settle_s=0)
        broker.stop()
        started = time.monotonic()
        worker.stop()
        # The results were acknowledged, so losing the commit costs only duplicates: run() returns.
        await asyncio.wait_for(task, timeout=60)
        return time.monotonic() - started

    # Its own broker: stopping the session's shared one would break the other tests.
    stopped_after = asyncio.run(scenario(own_broker()))
    assert stopped_after < 15, stopped_after
