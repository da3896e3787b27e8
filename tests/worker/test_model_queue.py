"""Batches queued on the model thread: a full batch starts as the running one ends, without waiting for the
event loop; the watchdog times each call from its own start; the open batch never queues."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from models import BatchPlan
from models.plan import take_turns
from schemas import ResultStatus, ScoreRequest, ScoreResult
from worker.config import WorkerSettings
from worker.errors import ModelStuckError
from worker.intake import Accepted, Launch, Outgoing
from worker.metrics import ResultTally, WorkerMetrics
from worker.pipeline import Pipeline

_TP = TopicPartition("score.requests", 0)


class _ModelThreadScorer:
    """Stands in for the Intake: each model call is recorded, optionally held, and timed on the thread."""

    def __init__(
        self,
        hold: Callable[[int], None] = lambda call: None,
        hold_encode: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.calls: list[list[str]] = []
        self.encodes = 0
        self._hold_encode = hold_encode
        self.answered: list[int] = []  # offsets, in the order their results were encoded
        self.started = [threading.Event() for _ in range(8)]
        self._hold = hold
        self.plan = BatchPlan()  # nothing shared: a batch counts the tokens its prompts hold
        self.events: list[tuple[str, list[str]]] = []  # launches and finishes, in order

    def prepare_all(self, records: Sequence[Any]) -> list[Accepted]:
        return [_accepted(record) for record in records]

    def launch(self, prepared: Sequence[Any]) -> Launch:
        call = len(self.calls)
        ids = [p.request.request_id for p in prepared]
        self.calls.append(ids)
        self.events.append(("launch", ids))
        self.started[call].set()
        self._hold(call)
        return Launch(prepared, None)  # results are built in finish, as the engine does

    def finish(self, launch: Launch) -> list[ScoreResult]:
        self.events.append(("finish", [p.request.request_id for p in launch.prepared]))
        return launch.results if launch.results is not None else _results(launch.prepared)

    def encode(self, answers: Sequence[tuple[Accepted, ScoreResult]]) -> Outgoing:
        self.answered.extend(accepted.offset for accepted, _ in answers)
        return Outgoing([], ResultTally(), [])


def _results(prepared: Sequence[Any]) -> list[ScoreResult]:
    return [ScoreResult(p.request.request_id, ResultStatus.OK, scores=((0.0,),)) for p in prepared]


def _accepted(offset: int) -> Accepted:
    request = ScoreRequest(request_id=f"r{offset}", items=("a",), query="q")
    prepared = SimpleNamespace(request=request, prompts=[[1, 2]], num_tokens=2)
    return Accepted(_TP, offset, None, request, prepared, 0, 10, time.monotonic())


class _Harness:
    def __init__(self, tmp_path: Path, scorer: _ModelThreadScorer, **settings: Any) -> None:
        values: dict[str, Any] = {"bootstrap_servers": "unused:9092", "model_dir": tmp_path}
        values |= {"max_batch_requests": 2, "max_wait_ms": 60_000, "watchdog_ms": 0} | settings
        self.tasks: list[asyncio.Task[None]] = []
        self.pipeline = Pipeline(
            WorkerSettings(**values),
            scorer,  # type: ignore[arg-type]
            WorkerMetrics("test", registry=CollectorRegistry()),
            _deliver,
            lambda coro: self.tasks.append(asyncio.get_running_loop().create_task(coro)),
        )

    async def settle(self) -> list[BaseException]:
        """Until every spawned task has ended (tasks spawn more); their errors."""
        while pending := [task for task in self.tasks if not task.done()]:
            await asyncio.wait(pending, timeout=10)
        return [error for task in self.tasks if (error := task.exception()) is not None]


async def _deliver(outgoing: Outgoing) -> None:
    """Publishing is not what these tests look at: the scorer records what was answered."""


def _wait(event: threading.Event, timeout_s: float = 10.0) -> bool:
    return event.wait(timeout_s)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_full_batch_starts_as_the_running_one_ends_without_an_event_loop_turn(
    tmp_path: Path, depth: int
) -> None:
    asyncio.run(_full_batch_starts_at_once(tmp_path, depth))


async def _full_batch_starts_at_once(tmp_path: Path, depth: int) -> None:
    release = threading.Event()
    scorer = _ModelThreadScorer(hold=lambda call: _wait(release) if call == 0 else None)
    harness = _Harness(tmp_path, scorer, model_queue_depth=depth)
    await harness.pipeline.accept([0, 1])  # type: ignore[list-item]  # closes full: runs, held
    assert await asyncio.to_thread(_wait, scorer.started[0])
    await harness.pipeline.accept([2, 3])  # type: ignore[list-item]  # closes full while the model runs
    # The event loop is blocked from here on: only a batch already on the model thread can start.
    release.set()
    started_blocked = scorer.started[1].wait(1.0)
    assert started_blocked is (depth == 2)
    assert await harness.settle() == []
    assert scorer.calls == [["r0", "r1"], ["r2", "r3"]]
    assert scorer.answered == [0, 1, 2, 3]
    assert not harness.pipeline.model_busy


def test_a_queued_batch_is_launched_before_the_one_ahead_is_finished(tmp_path: Path) -> None:
    """With a batch queued behind it, a call only launches its batch; the next call launches its own and
    then finishes the one ahead, so the device never waits for the host to build results. Results go
    out in batch order either way, and the last batch is finished by its own call."""
    asyncio.run(_queued_batch_launched_first(tmp_path))


async def _queued_batch_launched_first(tmp_path: Path) -> None:
    release = threading.Event()
    scorer = _ModelThreadScorer(hold=lambda call: _wait(release) if call == 0 else None)
    harness = _Harness(tmp_path, scorer, model_queue_depth=2)
    await harness.pipeline.accept([0, 1])  # type: ignore[list-item]  # launched, held
    assert await asyncio.to_thread(_wait, scorer.started[0])
    await harness.pipeline.accept([2, 3])  # type: ignore[list-item]  # queued behind it
    release.set()
    assert await harness.settle() == []
    first, second = ["r0", "r1"], ["r2", "r3"]
    assert scorer.events == [("launch", first), ("launch", second), ("finish", first), ("finish", second)]
    assert scorer.answered == [0, 1, 2, 3]
    # Nothing is left launched: a later lone batch is finished by its own call.
    await harness.pipeline.accept([4, 5])  # type: ignore[list-item]
    assert await harness.settle() == []
    assert scorer.events[-2:] == [("launch", ["r4", "r5"]), ("finish", ["r4", "r5"])]
    assert scorer.answered == [0, 1, 2, 3, 4, 5]


def test_the_open_batch_keeps_filling_while_the_model_runs_and_closes_when_it_ends(tmp_path: Path) -> None:
    asyncio.run(_open_batch_keeps_filling(tmp_path))


async def _open_batch_keeps_filling(tmp_path: Path) -> None:
    release = threading.Event()
    scorer = _ModelThreadScorer(hold=lambda call: _wait(release) if call == 0 else None)
    harness = _Harness(tmp_path, scorer, max_batch_requests=3, model_queue_depth=2)
    await harness.pipeline.accept([0, 1, 2])  # type: ignore[list-item]
    assert await asyncio.to_thread(_wait, scorer.started[0])
    await harness.pipeline.accept([3])  # type: ignore[list-item]  # open, not full: it must not queue
    await harness.pipeline.accept([4])  # type: ignore[list-item]
    assert harness.pipeline.due_in() is None  # no clock while the model runs: it closes when that ends
    assert not scorer.started[1].wait(0.3)
    assert harness.pipeline.model_busy
    release.set()
    assert await harness.settle() == []
    assert scorer.calls == [["r0", "r1", "r2"], ["r3", "r4"]]


def test_by_default_a_request_that_finds_the_model_idle_starts_at_once(tmp_path: Path) -> None:
    """The default wait is none: a lone request is not held for company (that would add the whole wait to
    its latency); those arriving while it runs still gather into the next batch."""
    asyncio.run(_idle_model_starts_at_once(tmp_path))


async def _idle_model_starts_at_once(tmp_path: Path) -> None:
    release = threading.Event()
    scorer = _ModelThreadScorer(hold=lambda call: _wait(release) if call == 0 else None)
    default_wait = WorkerSettings.model_fields["max_wait_ms"].default
    harness = _Harness(tmp_path, scorer, max_batch_requests=8, max_wait_ms=default_wait)
    await harness.pipeline.accept([0])  # type: ignore[list-item]
    assert harness.pipeline.due_in() == 0.0  # due now: the fetch loop's next check starts it
    harness.pipeline.dispatch_due()
    assert await asyncio.to_thread(_wait, scorer.started[0])
    for offset in (1, 2, 3):  # arrive one by one while the first runs
        await harness.pipeline.accept([offset])  # type: ignore[list-item]
        harness.pipeline.dispatch_due()
    assert not scorer.started[1].wait(0.2)
    release.set()
    assert await harness.settle() == []
    assert scorer.calls == [["r0"], ["r1", "r2", "r3"]]


def test_the_watchdog_times_a_queued_batch_from_its_own_start(tmp_path: Path) -> None:
    asyncio.run(_watchdog_from_own_start(tmp_path))


async def _watchdog_from_own_start(tmp_path: Path) -> None:
    # Each call takes 0.5 s against a 0.9 s limit; the queued one ends 1.0 s after it was handed over.
    scorer = _ModelThreadScorer(hold=lambda call: time.sleep(0.5))
    harness = _Harness(tmp_path, scorer, model_queue_depth=2, watchdog_ms=900, watchdog_multiple=1.0)
    await harness.pipeline.accept([0, 1])  # type: ignore[list-item]
    await harness.pipeline.accept([2, 3])  # type: ignore[list-item]
    assert await harness.settle() == []
    assert len(scorer.calls) == 2


def test_a_queued_batch_that_hangs_is_still_caught_by_the_watchdog(tmp_path: Path) -> None:
    asyncio.run(_queued_hang_caught(tmp_path))


async def _queued_hang_caught(tmp_path: Path) -> None:
    release = threading.Event()
    scorer = _ModelThreadScorer(hold=lambda call: _wait(release) if call == 1 else None)
    harness = _Harness(tmp_path, scorer, model_queue_depth=2, watchdog_ms=500, watchdog_multiple=1.0)
    try:
        await harness.pipeline.accept([0, 1])  # type: ignore[list-item]
        await harness.pipeline.accept([2, 3])  # type: ignore[list-item]
        errors = await harness.settle()
        assert [type(error) for error in errors] == [ModelStuckError]
        assert "2 requests" in str(errors[0])
        assert harness.pipeline.model_busy  # the thread is still in the hung call
        assert scorer.answered == [0, 1]
    finally:
        release.set()
        harness.pipeline.close()


def test_items_over_the_budget_take_turns_with_ordinary_batches(tmp_path: Path) -> None:
    """An item longer than the token budget (which nothing can cut) is a batch of its own that takes its
    turn with ordinary batches, as the parts of large requests do: the requests of a backlog behind four
    such items wait for one of them per ordinary batch, not for all four first (models.plan.take_turns)."""
    asyncio.run(_long_items_take_turns(tmp_path))


class _LongItemsScorer(_ModelThreadScorer):
    """Requests of 2 tokens, but those at `long` offsets hold one prompt of 50 (the budget is 10)."""

    def __init__(self, long: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.long = long
        self.started = [threading.Event() for _ in range(16)]  # nine calls here

    def prepare_all(self, records: Sequence[Any]) -> list[Accepted]:
        accepted = []
        for offset in records:
            tokens = 50 if offset in self.long else 2
            request = ScoreRequest(request_id=f"r{offset}", items=("a",))
            prepared = SimpleNamespace(request=request, prompts=[list(range(tokens))], num_tokens=tokens)
            accepted.append(Accepted(_TP, offset, None, request, prepared, 0, 10, time.monotonic()))
        return accepted


async def _long_items_take_turns(tmp_path: Path) -> None:
    release = threading.Event()
    scorer = _LongItemsScorer({0, 2, 3, 5, 6}, hold=lambda call: _wait(release) if call == 0 else None)
    harness = _Harness(tmp_path, scorer, max_batch_tokens=10, model_queue_depth=1)
    await harness.pipeline.accept([0])  # type: ignore[list-item]  # a long item: runs alone, held
    assert await asyncio.to_thread(_wait, scorer.started[0])
    await harness.pipeline.accept(list(range(1, 13)))  # type: ignore[arg-type]  # the backlog behind it
    release.set()
    assert await harness.settle() == []
    ordinary = [["r1", "r4"], ["r7", "r8"], ["r9", "r10"], ["r11", "r12"]]  # closed at 2 requests each
    large = [["r2"], ["r3"], ["r5"], ["r6"]]
    assert scorer.calls == [["r0"], *take_turns(ordinary, large)]
    assert scorer.calls[1:] == [
        ["r1", "r4"], ["r2"], ["r7", "r8"], ["r3"], ["r9", "r10"], ["r5"], ["r11", "r12"], ["r6"],
    ]  # fmt: skip
    assert sorted(scorer.answered) == list(range(13))


def test_requests_that_came_before_a_long_item_go_before_it(tmp_path: Path) -> None:
    """The model idle, two requests wait in the open batch (its wait not over) when an item over the
    budget arrives: they close their batch and run first, rather than wait for the long item."""
    asyncio.run(_earlier_requests_first(tmp_path))


async def _earlier_requests_first(tmp_path: Path) -> None:
    scorer = _LongItemsScorer({3})
    harness = _Harness(tmp_path, scorer, max_batch_tokens=10, max_batch_requests=4, model_queue_depth=1)
    await harness.pipeline.accept([1, 2])  # type: ignore[list-item]  # open, waiting up to max_wait_ms
    assert scorer.calls == []
    await harness.pipeline.accept([3])  # type: ignore[list-item]  # a long item
    await harness.pipeline.accept([4])  # type: ignore[list-item]  # and one behind it
    assert await harness.settle() == []
    harness.pipeline.flush()
    assert await harness.settle() == []
    assert scorer.calls == [["r1", "r2"], ["r3"], ["r4"]]
