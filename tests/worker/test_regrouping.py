"""Closed batches waiting for the model are ordered again as one sequence: requests that share a prompt join
wherever they arrived, so best-of-N answers interleaved with other prompts' compute each prompt once more at
most (in the batch that was already running), not once per batch they happened to close in; a request that
shares nothing is overtaken by at most `max_inflight_requests` later ones."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiokafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from models import BatchPlan
from schemas import ResultStatus, ScoreRequest, ScoreResult
from worker.config import WorkerSettings
from worker.intake import Accepted, Launch, Outgoing
from worker.metrics import ResultTally, WorkerMetrics
from worker.pipeline import Pipeline

_TP = TopicPartition("score.requests", 0)
MIN_TOKENS = 8
PROMPT_TOKENS, ANSWER_TOKENS = 40, 4


class _Scorer:
    """Stands in for the Intake: records each model call's requests; the first call waits to be released,
    so everything accepted meanwhile waits in closed batches."""

    def __init__(self, prompts: dict[int, tuple[int, ...]]) -> None:
        self.plan = BatchPlan(MIN_TOKENS)
        self._prompts = prompts
        self.calls: list[list[Any]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.answered: list[int] = []

    def prepare_all(self, records: Sequence[int]) -> list[Accepted]:
        out = []
        for offset in records:
            prompt = self._prompts[offset]
            request = ScoreRequest(request_id=f"r{offset}", items=(prompt,))
            prepared = SimpleNamespace(request=request, prompts=(prompt,), num_tokens=len(prompt))
            out.append(Accepted(_TP, offset, None, request, prepared, 0, 10, time.monotonic()))
        return out

    def launch(self, prepared: Sequence[Any]) -> Launch:
        self.calls.append(list(prepared))
        if len(self.calls) == 1:
            self.started.set()
            assert self.release.wait(10)
        return Launch(prepared, None)

    def finish(self, launch: Launch) -> list[ScoreResult]:
        return [ScoreResult(p.request.request_id, ResultStatus.OK, scores=((0.0,),)) for p in launch.prepared]

    def encode(self, answers: Sequence[tuple[Accepted, ScoreResult]]) -> Outgoing:
        self.answered.extend(accepted.offset for accepted, _ in answers)
        return Outgoing([], ResultTally(), [])

    def computed(self) -> list[int]:
        """What each call computed: its prompts' tokens, prefixes shared inside it once."""
        return [self.plan.tokens([p for r in call for p in r.prompts]) for call in self.calls]

    def launched(self) -> list[int]:
        return [int(r.request.request_id[1:]) for call in self.calls for r in call]


async def _run(tmp_path: Path, prompts: dict[int, tuple[int, ...]], **settings: Any) -> tuple[_Scorer, float]:
    scorer = _Scorer(prompts)
    values: dict[str, Any] = {"bootstrap_servers": "unused:9092", "model_dir": tmp_path, "watchdog_ms": 0}
    values |= {"max_wait_ms": 0, "model_queue_depth": 1} | settings
    tasks: list[asyncio.Task[None]] = []
    metrics = WorkerMetrics("test", registry=CollectorRegistry())
    pipeline = Pipeline(
        WorkerSettings(**values),
        scorer,  # type: ignore[arg-type]
        metrics,
        _deliver,
        lambda coro: tasks.append(asyncio.get_running_loop().create_task(coro)),
    )
    offsets = sorted(prompts)
    await pipeline.accept(offsets[:1])  # type: ignore[arg-type]
    pipeline.dispatch_due()  # the model idles and max_wait_ms is 0: it starts at once
    assert await asyncio.to_thread(scorer.started.wait, 10)
    for start in range(1, len(offsets), 5):  # fetched in pieces while the model runs
        await pipeline.accept(offsets[start : start + 5])  # type: ignore[arg-type]
    pipeline.flush()  # the open batch closes (as it would when the model's call ends)
    scorer.release.set()
    while pending := [task for task in tasks if not task.done()]:
        await asyncio.wait(pending, timeout=10)
    assert [error for task in tasks if (error := task.exception()) is not None] == []
    regrouped = metrics.registry.get_sample_value(
        "score_worker_regrouped_requests_total", {"model": "", "worker": "test"}
    )
    return scorer, regrouped or 0.0


async def _deliver(outgoing: Outgoing) -> None:
    """Publishing is not what these tests look at: the scorer records what was answered."""


def _interleaved(prompts: int, answers: int) -> dict[int, tuple[int, ...]]:
    """Best-of-N: `prompts` prompts of PROMPT_TOKENS with `answers` answers each, the answers interleaved
    (request k answers prompt k % prompts)."""
    out = {}
    for k in range(prompts * answers):
        prompt, answer = k % prompts, k // prompts
        out[k] = (
            *range(1000 * (prompt + 1), 1000 * (prompt + 1) + PROMPT_TOKENS),
            *[answer + 1] * ANSWER_TOKENS,
        )
    return out


def test_interleaved_answers_waiting_in_closed_batches_compute_each_prompt_once(tmp_path: Path) -> None:
    prompts = _interleaved(6, 8)
    # Budget: three requests in arrival order (3 x 44 = 132; none of three neighbours share), or two
    # prompts' groups once grouped (40 + 8 x 4 = 72 each).
    scorer, regrouped = asyncio.run(_run(tmp_path, prompts, max_batch_tokens=150, max_batch_requests=64))
    assert sorted(scorer.answered) == sorted(prompts)  # every request answered once
    assert sorted(scorer.launched()) == sorted(prompts)
    # The running call: request 0 alone. Then every prompt's answers side by side: prompt 0 once more (it
    # was in the running call), each prompt's 40 tokens once, two groups a batch.
    distinct = 6 * PROMPT_TOKENS + 48 * ANSWER_TOKENS
    assert sum(scorer.computed()) == distinct + PROMPT_TOKENS
    assert len(scorer.calls) == 1 + 3
    assert regrouped > 0
    # Arrival order, as the batches closed, would compute every prompt once per request (three requests
    # a batch, never two answers of one prompt): 48 x 44 tokens.
    unordered = BatchPlan(MIN_TOKENS)
    closed = [list(range(k, min(k + 3, 48))) for k in range(1, 48, 3)]
    assert sum(unordered.tokens([prompts[k] for k in batch]) for batch in closed) == 47 * 44


def test_a_request_that_shares_nothing_is_overtaken_by_at_most_the_inflight_bound(tmp_path: Path) -> None:
    """Request 2 shares nothing; every other request shares one prompt. Grouping would put all of them
    ahead of it; it lets only those that arrived within `max_inflight_requests` of the oldest waiting."""
    base = tuple(range(500, 540))
    prompts = {k: (*base, 7, k) for k in range(40)}
    prompts[2] = tuple(range(2000, 2044))
    reach = 6
    # Three requests a batch: 0 runs; 1, 2, 3 and the rest wait in closed batches of three.
    limits = {"max_batch_tokens": 10_000, "max_batch_requests": 3}
    scorer, _ = asyncio.run(_run(tmp_path, prompts, max_inflight_requests=reach, **limits))
    launched = scorer.launched()
    assert sorted(launched) == sorted(prompts)
    overtaking = [k for k in launched[: launched.index(2)] if k > 2]
    assert overtaking == [3, 4, 5, 6, 7]  # arrived within 6 of request 1, the oldest waiting
    # Without the bound (the default holds more than this stream) it waits for the whole stream.
    scorer, _ = asyncio.run(_run(tmp_path, prompts, **limits))
    assert scorer.launched()[-1] == 2


def test_batches_that_share_nothing_run_as_they_closed(tmp_path: Path) -> None:
    prompts = {k: tuple(range(100 * k + 1, 100 * k + 45)) for k in range(20)}
    scorer, regrouped = asyncio.run(_run(tmp_path, prompts, max_batch_tokens=100, max_batch_requests=64))
    assert scorer.launched() == list(range(20))
    assert [len(call) for call in scorer.calls] == [1] + [2] * 9 + [1]
    assert regrouped == 0
