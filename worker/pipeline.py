"""The pipeline: prepare fetched requests, batch them, run the model on its own thread, watch it, answer."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import ConsumerRecord

from models.plan import join_results, order_of_places
from schemas import ResultStatus, ScoreResult
from worker.batcher import Batch, TokenBudgetBatcher
from worker.config import WorkerSettings
from worker.errors import ModelStuckError
from worker.intake import Accepted, Intake, Launch, Outgoing, Rejected
from worker.intake_processes import IntakeProcesses
from worker.metrics import ResultTally, WorkerMetrics

log = logging.getLogger(__name__)

Answers = list[tuple[Accepted, ScoreResult]]
Deliver = Callable[[Outgoing], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None]], None]
# Fetched records that go to the intake processes even while the model idles.
_BURST_RECORDS = 16


@dataclass(eq=False)
class _Assembly:
    """The parts of a request too large for one batch: their results, until all are in (or one failed)."""

    results: list[ScoreResult | None]
    finished: bool = False


@dataclass(eq=False)
class Unit:
    """One entry of a model batch: a whole request, or one part of a large request."""

    accepted: Accepted
    prepared: Any
    tokens: int
    assembly: _Assembly | None = None
    part: int = 0
    arrival: int = 0  # the order the pipeline queued it in (parts of one request share their request's)


@dataclass(eq=False)
class _LaunchedUnits:
    """A batch on the model thread whose live units are launched on the device and not yet finished."""

    units: list[Unit]
    live: list[Unit]
    answers: list[tuple[Accepted, ScoreResult]]  # answered without the model (expired)
    launch: Launch | None


@dataclass
class Watchdog:
    """How long a model call may run: `multiple` times its expected time, never less than `floor_s`.

    The expected time is the token count times seconds per token, averaged over recent calls.
    """

    floor_s: float
    multiple: float
    seconds_per_token: float | None = None
    _alpha: float = field(default=0.2, repr=False)

    def limit_s(self, tokens: int) -> float | None:
        if self.floor_s <= 0:
            return None
        expected = (self.seconds_per_token or 0.0) * max(tokens, 1)
        return max(self.floor_s, self.multiple * expected)

    def observe(self, tokens: int, seconds: float) -> None:
        rate = seconds / max(tokens, 1)
        previous = self.seconds_per_token
        self.seconds_per_token = rate if previous is None else previous + self._alpha * (rate - previous)


class Pipeline:
    """Owns the batcher and the model thread. `accept` takes fetched records; answers go to `deliver`.

    Requests larger than one batch are cut into parts (models.plan) that take turns with ordinary
    batches, so small requests behind a large one wait for about one batch, not for all of it. An item
    longer than the budget, which nothing can cut (a long-context prompt), is a batch of its own that
    takes its turn the same way: requests behind several long items wait for one of them per batch of
    their own, not for every one queued (models.plan.take_turns: the order a backlog runs in).

    Up to `model_queue_depth` batches are on the model thread at once: the running one and closed batches
    queued behind it. A batch closed full while the model runs is handed over at once, so it starts as the
    running one ends, not after the event loop (busy publishing and fetching) gets round to it. Only closed
    batches queue: the open batch keeps filling until the thread has nothing left to run.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        intake: Intake,
        metrics: WorkerMetrics,
        deliver: Deliver,
        spawn: Spawn,
        intake_processes: IntakeProcesses | None = None,
    ) -> None:
        self._settings = settings
        self._intake_processes = intake_processes
        self._intake = intake
        self._metrics = metrics
        self._deliver = deliver
        self._spawn = spawn
        # With shared prefixes computed once, budgets count what a batch computes, not what it holds.
        # Requests sharing a prefix are kept in one batch where a batch closes between them.
        self._plan = intake.plan
        self._measure = self._plan.batch_measure
        joins = self._plan.batch_joins
        self._batcher: TokenBudgetBatcher[Unit] = TokenBudgetBatcher(
            settings.max_batch_tokens,
            settings.max_batch_requests,
            settings.max_wait_ms / 1000,
            measure=None if self._measure is None else self._units_tokens,
            joins=None if joins is None else (lambda a, b: joins(a.prepared, b.prepared)),
        )
        # Closed batches not yet handed to the model thread. While it is busy, arriving requests keep filling
        # the open batch instead of being cut into small batches queued behind it.
        self._ready: deque[list[Unit]] = deque()
        # Requests waiting for the model are ordered again before the next batch starts, when some came since
        # the last time: requests that share a prompt join wherever they arrived (_regroup).
        self._next_arrival = 0  # the arrival number of the next request queued
        self._arrived_by = 0  # the next arrival number when the waiting requests were last ordered
        self._large: deque[Unit] = deque()  # parts of large requests, in order
        self._large_turn = False
        self._depth = settings.model_queue_depth
        self._submitted = 0  # batches handed to the model thread and not yet finished (running or queued)
        self._last_call: asyncio.Future[list[Outgoing]] | None = None  # the next queues behind
        # Calls handed to the model thread that it has not begun (changed by both threads, under the lock):
        # a call that sees one behind it leaves its batch launched for that one to finish.
        self._not_started = 0
        self._queue_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by the first hand-over to the model thread
        self._deferred: _LaunchedUnits | None = None  # for the next call to finish (model thread only)
        self._running = 0  # model calls executing on the thread right now (0 or 1; set by the thread)
        self._closed = False
        self.watchdog = Watchdog(settings.watchdog_ms / 1000, settings.watchdog_multiple)
        self._tokens_since_trim = 0
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="score-model")
        # Tokenising off the loop keeps heartbeats timely; its own thread lets it overlap a forward pass.
        self._prepare_thread = ThreadPoolExecutor(1, thread_name_prefix="score-prepare")
        self.progress = asyncio.Event()  # set whenever a batch finishes or records were accepted

    @property
    def intake_processes(self) -> IntakeProcesses | None:
        return self._intake_processes

    @property
    def model_busy(self) -> bool:
        """A model call is executing on the model thread (queued batches not counted: closing the pipeline
        cancels them)."""
        return self._running > 0

    def due_in(self) -> float | None:
        """Seconds until the open batch must close; None when nothing waits for the clock."""
        return None if self._submitted else self._batcher.due_in()

    async def accept(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        """Decode and tokenise (in the intake processes while the model runs or for a burst, else on the
        prepare thread); answer the rejected; queue the rest for the model."""
        loop = asyncio.get_running_loop()
        processes = self._intake_processes
        # One record while the model idles is quicker on the thread than through a process and back.
        if processes is not None and processes.ready and (self._submitted or len(records) >= _BURST_RECORDS):
            ready = await processes.prepare([record.value or b"" for record in records])
            prepare = functools.partial(self._intake.prepare_all, records, ready)
        else:
            prepare = functools.partial(self._intake.prepare_all, records)
        outcomes = await loop.run_in_executor(self._prepare_thread, prepare)
        rejected = [o for o in outcomes if isinstance(o, Rejected)]
        if rejected:
            self._spawn(self._answer_rejected(rejected))
        for outcome in outcomes:
            if isinstance(outcome, Accepted):
                self._queue(outcome)
        self._dispatch()
        # A revocation that began while these were being prepared is waiting for them: wake it to close
        # the batch they joined (the fetch loop cannot: getmany blocks until the rebalance is over).
        self.progress.set()

    def _queue(self, accepted: Accepted) -> None:
        parts = self._plan.parts(accepted.prepared, self._settings.max_batch_tokens)
        arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
        if len(parts) == 1:
            unit = Unit(accepted, accepted.prepared, self._tokens(accepted.prepared), arrival=arrival)
            if unit.tokens > self._settings.max_batch_tokens:  # one item over the budget: a turn of its own
                self._large.append(unit)
                return
            for batch in self._batcher.add(unit, unit.tokens):
                self._ready.append(list(batch.items))
            return
        assembly = _Assembly([None] * len(parts))
        self._large.extend(
            Unit(accepted, p, self._tokens(p), assembly, i, arrival) for i, p in enumerate(parts)
        )

    def _tokens(self, prepared: Any) -> int:
        """What a request (or part) computes: its prompts' tokens, a prefix they share counted once."""
        return prepared.num_tokens if self._measure is None else self._measure(prepared.prompts)

    def _units_tokens(self, units: Sequence[Unit]) -> int:
        """What units compute together in one batch."""
        if self._measure is None:
            return sum(u.tokens for u in units)
        return self._measure([prompt for u in units for prompt in u.prepared.prompts])

    def dispatch_due(self) -> None:
        """Close the open batch if its wait is over and start it when the model thread is free."""
        if not self._submitted:
            self._dispatch(self._batcher.take_due())

    def flush(self) -> None:
        """Close the open batch now (stopping, revoking) and hand it over if the model thread has room."""
        if self._submitted < self._depth:
            self._dispatch(self._batcher.flush())

    def close(self) -> None:
        """No new batch starts after this; threads are released (a stuck model call is left behind)."""
        self._closed = True
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        self._prepare_thread.shutdown(wait=False, cancel_futures=True)
        if self._intake_processes is not None:
            self._intake_processes.close()

    def _dispatch(self, closed: Batch[Unit] | None = None) -> None:
        if closed is not None:
            self._ready.append(list(closed.items))
        while not self._closed and self._submitted < self._depth:
            if self._submitted and not self._ready and len(self._batcher):
                # Requests wait in the open batch: it closes when the thread has nothing left and then
                # takes its turn with the parts of large requests, which must not queue ahead of it.
                return
            units = self._next_batch()
            if not units:
                return
            self._submit(units)

    def _next_batch(self) -> list[Unit] | None:
        """Ordinary batches and large turns (parts of large requests, items over the budget) take turns when
        both are waiting, an ordinary batch first (models.plan.take_turns). An open batch holding requests
        that arrived before the next large turn closes and goes first, with what joined it since: a large
        turn takes as long as a full batch or (an item over the budget) longer, and they were there first."""
        # The open batch's items (a copy) are read only when a large turn would start with it waiting.
        waiting = bool(self._large) and not self._ready and len(self._batcher) > 0
        if waiting and self._batcher.items[0].arrival < self._large[0].arrival:
            closed = self._batcher.flush()
            if closed is not None:
                self._ready.append(list(closed.items))
                self._large_turn = False
        if self._large and (not self._ready or self._large_turn):
            self._large_turn = False
            return [self._large.popleft()]
        if self._ready:
            self._large_turn = True
            self._regroup()
            return self._ready.popleft()
        return None

    def _regroup(self) -> None:
        """Order the requests waiting for the model again, as one sequence, before the next batch starts:
        the closed batches' requests side by side with the others that share their prompt's prefix,
        wherever they arrived (`BatchPlan.grouped_places`), then cut again by the token budget (shared
        prefixes once) and the request limit. Requests of the open batch that share a prefix with a waiting
        one join it; the rest stay open. A batch closes on arrival order: while the model is busy, best-of-N
        answers interleaved with other prompts' spread over several closed batches, each computing the
        prompt again.

        A request moves ahead only if it arrived at most `max_inflight_requests` after the oldest waiting
        one, so a request that shares nothing is overtaken by at most that many later ones (what the worker
        holds at once anyway), however long a stream sharing one prompt runs. Runs only when requests came
        since the last time and another batch waits behind the next; where nothing is shared the batches
        stay as they closed, for one sort of the waiting requests' first prompts."""
        newest = self._arrived_by
        self._arrived_by = self._next_arrival
        if newest == self._next_arrival or not self._plan.shares_prefixes:
            return
        waiting = [unit for batch in self._ready for unit in batch]
        open_units = self._batcher.items
        if len(self._ready) < 2 and not open_units:
            return
        sequence = [*waiting, *open_units]
        places = self._plan.grouped_places(
            [u.prepared for u in sequence],
            arrivals=[u.arrival for u in sequence],
            reach=self._settings.max_inflight_requests,
        )
        count = len(waiting)
        pulled = [unit for index, unit in enumerate(sequence[count:], count) if places[index] < count]
        order = [index for index in order_of_places(places) if index < count or places[index] < count]
        if not pulled and order == list(range(count)):
            return
        if pulled:
            self._batcher.take(pulled)
        before = {id(unit): number for number, batch in enumerate(self._ready) for unit in batch}
        ordered = [sequence[k] for k in order]
        limit = self._settings.max_batch_requests
        runs = self._plan.grouped_runs(
            [u.prepared for u in ordered], [places[k] for k in order], self._settings.max_batch_tokens
        )
        batches = [
            ordered[start : min(run.stop, start + limit)]
            for run in runs
            for start in range(run.start, run.stop, limit)
        ]
        moved = sum(
            1 for number, batch in enumerate(batches) for unit in batch if before.get(id(unit)) != number
        )
        self._ready = deque(batches)
        self._metrics.regrouped(moved)

    def _model_done(self) -> None:
        """A model call ended. When the thread has nothing left, what gathered while it was busy has waited
        a whole forward pass, so the open batch closes now rather than after max_wait (keeps batches as
        large as arrivals allow); while a queued batch runs, the open batch keeps filling."""
        self._submitted -= 1
        if self._closed:
            return
        if self._submitted:
            self._dispatch()
        else:
            self._dispatch(None if self._ready else self._batcher.flush())

    def _submit(self, units: list[Unit]) -> None:
        """Hand a batch to the model thread now; it runs after the calls already there."""
        with self._queue_lock:
            self._not_started += 1
        self._loop = asyncio.get_running_loop()
        future = self._loop.run_in_executor(self._model_thread, self._score, units)
        before, self._last_call = self._last_call, future
        self._submitted += 1
        self._spawn(self._run(units, future, before))

    async def _run(
        self,
        units: list[Unit],
        future: asyncio.Future[list[Outgoing]],
        before: asyncio.Future[list[Outgoing]] | None,
    ) -> None:
        if before is not None and not before.done():
            # Queued behind it: this call's clock (watchdog, wait metrics) starts when that one ends. Its own
            # task reports how it ended.
            await asyncio.wait([before])
        tokens = self._units_tokens(units)
        started = time.monotonic()
        self._metrics.batch_started(len(units), tokens, (started - u.accepted.ready_at for u in units))
        limit = self.watchdog.limit_s(tokens)
        try:
            finished = await asyncio.wait_for(asyncio.shield(future), limit)
        except TimeoutError:
            # Not _model_done(): the thread is still in the call, and nothing may start behind it.
            ran_s = time.monotonic() - started
            raise ModelStuckError(
                f"a model call of {len(units)} requests ({tokens} tokens) has run {ran_s:.1f} s, past its "
                f"limit of {limit:.1f} s (watchdog_ms, watchdog_multiple); stopping without committing it"
            ) from None
        except BaseException:  # a fatal error, or cancelled at exit: nothing more starts on this thread
            self._closed = True
            raise
        self.watchdog.observe(tokens, time.monotonic() - started)
        self._model_done()
        for outgoing in finished:
            if outgoing.records:
                await self._deliver(outgoing)
        self.progress.set()

    def _score(self, units: list[Unit]) -> list[Outgoing]:
        """Runs on the model thread: expired requests answered unscored, the rest scored, parts joined,
        the answers encoded (a fraction of a millisecond a batch: no thread of its own, which would only
        contend for the interpreter lock with this one).

        With a batch queued behind this one, this one is only launched: the next call finishes it after
        launching its own (and hands it to the event loop to publish at once), so the device runs the next
        batch while the host builds this one's results. Returns what this call itself finished.
        """
        with self._queue_lock:
            self._not_started -= 1
        self._running += 1
        try:
            launched = self._launch_units(units)
            if self._deferred is not None:
                deferred, self._deferred = self._deferred, None
                finished = self._finish_units(deferred)
                # Delivered now, not with this call's own answers: this batch may yet hang or fail.
                loop = self._loop
                assert loop is not None, "a batch was launched without a hand-over from the loop"
                loop.call_soon_threadsafe(self._deliver_finished, finished)
            with self._queue_lock:
                next_queued = self._not_started > 0
            if next_queued:
                self._deferred = launched
                return []
            return [self._finish_units(launched)]
        finally:
            self._running -= 1

    def _deliver_finished(self, finished: Outgoing) -> None:
        """On the event loop: publish a batch that a later model call finished."""
        self._spawn(self._publish(finished))

    async def _publish(self, outgoing: Outgoing) -> None:
        if outgoing.records:
            await self._deliver(outgoing)
        self.progress.set()

    def _launch_units(self, units: list[Unit]) -> _LaunchedUnits:
        now_ms = time.time() * 1000
        answers: list[tuple[Accepted, ScoreResult]] = []
        live: list[Unit] = []
        for unit in units:
            if unit.assembly is not None and unit.assembly.finished:
                continue  # an earlier part failed or expired: the request is answered already
            expires = unit.accepted.expires_at_ms
            if expires is not None and now_ms >= expires:
                self._complete(unit, self._intake.expired(unit.accepted.request, expires), answers)
            else:
                live.append(unit)
        launch = self._intake.launch([u.prepared for u in live]) if live else None
        return _LaunchedUnits(units, live, answers, launch)

    def _finish_units(self, launched: _LaunchedUnits) -> Outgoing:
        answers = launched.answers
        if launched.launch is not None:
            results = self._intake.finish(launched.launch)
            for unit, result in zip(launched.live, results, strict=True):
                self._complete(unit, result, answers)
        return self._encode(answers, launched.units)

    def _encode(self, answers: Answers, units: list[Unit]) -> Outgoing:
        """The answers as records to publish, and now and then the heap trimmed."""
        self._tokens_since_trim += sum(u.tokens for u in units)
        large_done = any(u.assembly is not None and u.assembly.finished for u in units)
        if large_done or self._tokens_since_trim >= 8 * self._settings.max_batch_tokens:
            self._tokens_since_trim = 0
            _trim_heap()
        return self._intake.encode(answers)

    @staticmethod
    def _complete(unit: Unit, result: ScoreResult, answers: list[tuple[Accepted, ScoreResult]]) -> None:
        assembly = unit.assembly
        if assembly is None:
            answers.append((unit.accepted, result))
            return
        if assembly.finished:  # an earlier part failed while this one was already launched
            return
        assembly.results[unit.part] = result
        if result.status is ResultStatus.ERROR:
            assembly.finished = True
            answers.append((unit.accepted, result))
        elif all(r is not None for r in assembly.results):
            assembly.finished = True
            parts = [r for r in assembly.results if r is not None]
            answers.append((unit.accepted, join_results(parts, unit.accepted.request.compare)))

    async def _answer_rejected(self, rejected: Sequence[Rejected]) -> None:
        tally = ResultTally()
        for item in rejected:
            tally.merge(item.tally)
        records = [message for item in rejected for message in item.messages]
        sources = [(item.tp, item.offset) for item in rejected for _ in item.messages]
        await self._deliver(Outgoing(records, tally, sources))


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[assignment]
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give freed heap pages back to the system: glibc keeps them after large requests otherwise, and the
    worker's resident memory would stay at its peak."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
