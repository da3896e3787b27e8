"""ScoreWorker: the source, the pipeline and the sink of one worker, run together until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiokafka.structs import TopicPartition

from models import ScoringEngine
from worker.config import WorkerSettings
from worker.errors import ModelStuckError
from worker.gc_pauses import GcPauses, freeze_startup_heap, thaw_heap
from worker.health import Readiness
from worker.holds import Hold
from worker.intake import Intake, Outgoing, record_size
from worker.intake_processes import IntakeProcesses, process_count
from worker.metrics import ResultTally, WorkerMetrics
from worker.pipeline import Pipeline
from worker.publisher import unreadable_record
from worker.sink import Sink
from worker.source import Source
from worker.topics import broker_record_limit, ensure_topics

log = logging.getLogger(__name__)

# Longest the fetch loop sleeps in getmany: bounds how late stop() and periodic commits are noticed.
_POLL_MS = 200
# How often the fetch loop samples lag, pauses and in-flight counts into the metrics.
_SAMPLE_S = 1.0


class ScoreWorker:
    """One worker of the consumer group; `run()` until `stop()`, then it publishes what it holds and commits.

    Delivery is at least once: an offset is committed only after the broker acknowledged the result (and,
    for a rejected record, its dead-letter copy). Records are never skipped silently. Every wait is
    bounded: a stop by drain_timeout_ms, a revocation by revocation_timeout_ms, a model call by the
    watchdog, a publish by publish_timeout_ms.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        engine: ScoringEngine,
        metrics: WorkerMetrics | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self._settings = settings
        self._engine = engine
        if metrics is None:
            metrics = WorkerMetrics(settings.worker_id)
            metrics.bind_model(engine.info, settings.max_batch_tokens)
        self.metrics = metrics
        self.readiness = readiness or Readiness(metrics, model_loaded=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False
        self._fatal: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sink: Sink | None = None
        self._pipeline: Pipeline | None = None
        self._source: Source | None = None

    @property
    def in_flight(self) -> int:
        """Requests fetched but not yet fully published (what backpressure limits)."""
        return self._sink.pending() if self._sink is not None else 0

    @property
    def intake_processes(self) -> IntakeProcesses | None:
        """The processes that decode and tokenise requests, once the worker runs (None when it has none)."""
        return None if self._pipeline is None else self._pipeline.intake_processes

    @property
    def model_call_stuck(self) -> bool:
        """A model call is still running after the worker stopped (watchdog, or a drain that timed out):
        the process must exit without waiting for that thread."""
        return self._pipeline is not None and self._pipeline.model_busy

    def stop(self) -> None:
        """Ask the worker to stop fetching, publish what it holds, commit and return (thread/signal safe)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stop_requested = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._request_stop()
        else:
            loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        if not self._stop_requested:
            log.info("stop requested: %d fetched requests in flight, finishing them", self.in_flight)
        self._stop_requested = True

    async def run(self) -> None:
        """Consume until stop(); raises PublishError, ModelStuckError or DeviceLostError on a fatal error."""
        self._loop = asyncio.get_running_loop()
        settings = self._settings = await self._effective_settings()
        self._sink = Sink(settings, self.metrics, self._on_fenced)
        intake = Intake(settings, self._engine, self.metrics)
        processes = self._intake_processes(settings)
        self._pipeline = Pipeline(settings, intake, self.metrics, self._sink.deliver, self._spawn, processes)
        self._source = Source(
            settings, self.metrics, self.readiness, self._on_revoked, self._skip_unreadable,
            self._on_assigned if settings.exactly_once else None,
        )  # fmt: skip
        if settings.gc_freeze:
            frozen = freeze_startup_heap()
            log.info("%d objects alive at start (model, libraries) frozen out of garbage collection", frozen)
        try:
            with GcPauses(self.metrics.gc_paused):
                await self._sink.start(self._source.consumer.commit)
                try:
                    await self._run_source()
                finally:
                    await self._sink.stop()
        finally:
            self._pipeline.close()
            self.readiness.update(group_joined=False)
            if settings.gc_freeze:
                thaw_heap()
            for task in list(self._tasks):  # only left after an error: their offsets stay uncommitted
                task.cancel()
        if self._fatal is not None:
            raise self._fatal
        log.info("worker stopped")

    def _intake_processes(self, settings: WorkerSettings) -> IntakeProcesses | None:
        """Started here: they import their libraries while the worker joins its group."""
        count = process_count(settings.intake_processes, self._engine.info.device)
        if count == 0:
            return None
        builder = self._engine.prompt_builder
        metrics = self.metrics
        processes = IntakeProcesses(builder, count, metrics.prepared_in_processes, metrics.intake_restarted)
        processes.start()
        return processes

    async def _effective_settings(self) -> WorkerSettings:
        """Create missing topics; lower the record limit to the brokers' own where they report a lower one
        (a result between the two would be refused by the broker on every retry)."""
        settings = self._settings
        if settings.create_topics:
            await ensure_topics(settings)
        limit = await broker_record_limit(settings)
        if limit is not None and limit < settings.max_record_bytes:
            log.warning(
                "max_record_bytes is %d but the brokers accept at most %d bytes per record on the results "
                "or dead-letter topic; using %d", settings.max_record_bytes, limit, limit,
            )  # fmt: skip
            settings = settings.model_copy(update={"max_record_bytes": max(limit, 4096)})
        return settings

    async def _run_source(self) -> None:
        assert self._source is not None and self._sink is not None
        await self._source.start()
        probe = asyncio.get_running_loop().create_task(self._source.probe_broker(), name="broker-probe")
        try:
            await self._consume()
            await self._drain()
        finally:
            probe.cancel()
            # Commits only offsets whose records were fully published: safe after an error too.
            await self._sink.commit()
            await self._source.stop()

    async def _consume(self) -> None:
        assert self._source is not None and self._sink is not None and self._pipeline is not None
        source, sink, pipeline = self._source, self._sink, self._pipeline
        next_commit = time.monotonic() + self._settings.commit_interval_ms / 1000
        next_sample = time.monotonic()
        while not self._stop_requested and self._fatal is None:
            source.apply_backpressure(sink.pending())
            room = max(1, self._settings.max_inflight_requests - sink.pending())
            due = pipeline.due_in()
            timeout_ms = _POLL_MS if due is None else min(_POLL_MS, int(due * 1000))
            # Called even while paused: polling is what keeps this consumer in the group.
            if source.fully_paused():
                # Nothing can come back: wait for answers instead, so fetching resumes as soon as they
                # bring the in-flight count down (a 200 ms getmany would cap catching up on a backlog).
                records = await source.fetch(0, room)
                await self._wait_progress(timeout_ms / 1000)
            else:
                records = await source.fetch(timeout_ms, room)
            if records and (taken := self._track(records)):
                await pipeline.accept(taken)
            pipeline.dispatch_due()
            if time.monotonic() >= next_commit:
                sink.commit_soon()
                next_commit = time.monotonic() + self._settings.commit_interval_ms / 1000
            if time.monotonic() >= next_sample:
                await source.sample_state(sink.pending())
                next_sample = time.monotonic() + _SAMPLE_S

    async def _wait_progress(self, timeout_s: float) -> None:
        """Until a batch is answered or records were accepted, at most `timeout_s`."""
        assert self._pipeline is not None
        self._pipeline.progress.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._pipeline.progress.wait(), timeout=timeout_s)

    def _track(self, records: list[Any]) -> list[Any]:
        """Track fetched records; returns those to answer (exactly once, not those of a partition that is
        not open yet or was fenced: they are read again from the commit)."""
        assert self._sink is not None
        size = 0
        taken = []
        for record in records:
            if self._sink.track(TopicPartition(record.topic, record.partition), record.offset):
                taken.append(record)
            size += record_size(record)
        self.metrics.fetched(len(records), size)
        log.debug("fetched %d records, %d in flight", len(records), self._sink.pending())
        return taken

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # The first failure stops the worker; later ones are logged too, not swallowed.
            log.error("stopping: %s", error, exc_info=None if isinstance(error, ModelStuckError) else error)
            if isinstance(error, ModelStuckError):
                self.readiness.update(model_responsive=False)
            self._fatal = self._fatal or error
        if self._pipeline is not None:
            self._pipeline.progress.set()

    async def _drain(self) -> None:
        """Stop fetching and wait, at most drain_timeout_ms, until everything fetched is published."""
        assert self._source is not None and self._sink is not None
        self._source.stop_fetching()
        limit_s = self._settings.drain_timeout_ms / 1000
        if not await self._finish_in_flight(None, timeout_s=limit_s, keep_polling=True):
            log.warning(
                "stopping with %d requests unfinished after %.0f s (drain_timeout_ms): they are not "
                "committed, so the group delivers them again", self._sink.pending(), limit_s,
            )  # fmt: skip

    def _skip_unreadable(self, hold: Hold) -> None:
        """A batch that stayed unreadable is skipped: its range goes to the dead-letter topic, and the commit
        passes the range once the broker acknowledged that record."""
        assert self._sink is not None
        first, last = hold.offset, hold.last_offset
        data = hold.batch.data if hold.batch is not None else None
        record = unreadable_record(self._settings, hold.tp, first, last, hold.cause, hold.message, data)
        self._sink.track_range(hold.tp, first, last)
        tally = ResultTally()
        tally.add(record, 0)
        self._spawn(self._sink.deliver(Outgoing([record], tally, [(hold.tp, first)])))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Before losing partitions, let their in-flight requests finish (bounded), commit, forget them."""
        assert self._sink is not None
        limit_s = self._settings.revocation_timeout_ms / 1000
        if not await self._finish_in_flight(revoked, timeout_s=limit_s, keep_polling=False):
            log.warning("%d requests still in flight at revocation", self._sink.pending(revoked))
        await self._sink.commit(revoked)
        await self._sink.drop(revoked)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Exactly once: the partitions' transactional producers start (fencing their previous owners),
        then they are read from the group's commit; records of them fetched before that are not taken.
        Failing that, the worker stops: it must not read them."""
        assert self._sink is not None and self._source is not None
        try:
            await self._sink.open(assigned)
            await self._source.read_from_commit(assigned)
            self._sink.activate(assigned)  # no wait since the seek: nothing was handed out in between
        except Exception as error:
            self._source.consumer.pause(*assigned)
            log.error("stopping: %s", error)
            self._fatal = self._fatal or error
            raise

    def _on_fenced(self, tp: TopicPartition) -> None:
        """Exactly once, a partition's producer was fenced: stop reading it. A worker the group has moved
        on from learns so at its next heartbeat and rejoins; if the partition is still this worker's after
        that could have happened (the fence came from a transaction that outlived its timeout), it is
        opened again from the committed offset."""
        assert self._source is not None
        self._source.fence(tp)
        generation = self._source.generation
        wait_s = 2 * self._settings.session_timeout_ms / 1000
        self._spawn(self._reopen_later(tp, generation, wait_s))

    async def _reopen_later(self, tp: TopicPartition, generation: int, wait_s: float) -> None:
        assert self._source is not None and self._sink is not None
        await asyncio.sleep(wait_s)
        source = self._source
        if source.generation != generation or tp not in source.consumer.assignment() or self._stop_requested:
            return  # the group has reassigned it since: the assignment opened it
        log.warning(
            "%s is still this worker's %.0f s after its producer was fenced: opening it again",
            tp,
            wait_s,
        )
        await self._sink.open([tp])
        await source.read_from_commit({tp})
        self._sink.activate([tp])
        source.unfence(tp)

    async def _finish_in_flight(
        self, partitions: set[TopicPartition] | None, timeout_s: float, keep_polling: bool
    ) -> bool:
        """Wait until the fetched requests of `partitions` (all when None) are published; False on timeout.

        The open batch is closed on every wake-up, not once: requests that were still being prepared join
        it later. `keep_polling` calls getmany (nothing comes back: all paused) so that a long drain does
        not exceed max_poll_interval; a revocation must not, as getmany waits for the rebalance to end.
        """
        assert self._source is not None and self._sink is not None and self._pipeline is not None
        deadline = time.monotonic() + timeout_s
        while self._sink.pending(partitions) and self._fatal is None:
            self._pipeline.flush()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await self._wait_progress(min(remaining, _POLL_MS / 1000))
            if keep_polling:
                await self._source.fetch(0, 1)
        return True
