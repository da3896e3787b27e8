"""Kills of worker processes under a stream: the fault tests' bounds, when a kill lands and what it hit, and
the milestones of a worker's start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fault_kit.traffic import Stream, wait_until
from fault_kit.workers import WorkerProcess

MAX_INFLIGHT = 64
COMMIT_INTERVAL_S = 0.1  # worker_env's commit_interval_ms
POLL_S = 0.2  # the longest the worker's fetch loop waits between two looks at its commit timer
START_BOUND_S = 60.0
ALL_FOUR = r"assigned partitions: \[.*\[0\].*\[1\].*\[2\].*\[3\]"
# An open-ended stream runs until its fault has played out; this many seconds of traffic at most.
STREAM_CAP_S = 150.0

# A kill waits until the worker answers at no more than this times the stream's rate (`kill_when_steady`):
# the fastest rate at which answers can pile up uncommitted when it lands.
PACE = 1.25


def duplicate_bound(kills: int, rate: float, pace: float = PACE) -> int:
    """Results one kill -9 (or other fault) can duplicate: requests whose results were (partly) published
    but not yet marked done, at most max_inflight_requests, plus the done ones since the last commit: one
    commit interval and one fetch-loop wait at `pace` times the stream's rate (the most a kill waits for;
    1 where the fault does not wait), with 0.1 s for the commit's round trip."""
    return kills * (MAX_INFLIGHT + math.ceil(pace * rate * (COMMIT_INTERVAL_S + POLL_S + 0.1)))


@dataclass(frozen=True)
class KillReport:
    """What a kill -9 hit: results already out, requests the broker held but the worker had not answered."""

    at: float
    answered: int
    unanswered: int

    @classmethod
    def of(cls, stream: Stream, at: float) -> KillReport:
        # Taken after the stream ended: by then every result published before `at` has been seen.
        answered = stream.watcher.answered_before(at)
        acked = {stream.requests[i].request_id for i in stream.producer.acked_before(at)}
        return cls(at, len(answered), len(acked - answered))

    def check_mid_stream(self) -> None:
        assert self.answered > 0 and self.unanswered > 0, f"the kill did not land mid-stream: {self}"


async def kill_when_steady(worker: WorkerProcess, stream: Stream, answered_at_least: int) -> float:
    """kill -9 once the worker keeps pace with the stream and the stream is still running.

    Waiting out a backlog keeps the kill from landing while the worker publishes far faster than the stream
    (after a restart), where one commit interval covers more results than the bound allows for. On a busy
    host the worker may stay behind the stream by more than its in-flight requests; answering at the
    stream's pace is then what counts.
    """
    enough = f"{answered_at_least} answers"
    await wait_until(lambda: len(stream.watcher.first) >= answered_at_least, 60, enough)
    await wait_until(lambda: stream.keeps_pace(MAX_INFLIGHT, PACE), 60, "the worker to keep pace")
    assert stream.running(), "the stream reached its cap before the kill"
    return worker.kill()


@dataclass(frozen=True)
class StartFigures:
    """Seconds from a worker process's start (or a kill) to each milestone of its start-up."""

    loaded_s: float | None
    assigned_s: float
    first_result_s: float


async def start_figures(worker: WorkerProcess, stream: Stream) -> StartFigures:
    """Start-up milestones of a worker whose requests are already waiting."""
    loaded = await worker.wait_for("loaded model")
    assigned = await worker.wait_assigned()
    since = worker.started_at

    def published() -> float | None:
        return stream.watcher.first_after(since)

    await wait_until(lambda: published() is not None, START_BOUND_S, f"a result of {worker.name}")
    first = published()
    assert first is not None
    return StartFigures(loaded.at - since, assigned.at - since, first - since)
