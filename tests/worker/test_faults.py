"""Faults against real worker processes and a real broker: nothing lost, duplicates bounded, results right.

Here kill -9 of a worker mid-stream, alone or beside a second one; a stop and restart are in
test_faults_restarts.py, faults in what reaches the worker in test_faults_inputs.py (three files: in a
parallel run each file goes to one process, so these minutes of streams spread over the processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.kills import (
    ALL_FOUR,
    MAX_INFLIGHT,
    START_BOUND_S,
    STREAM_CAP_S,
    KillReport,
    StartFigures,
    duplicate_bound,
    kill_when_steady,
    start_figures,
)
from fault_kit.traffic import Stream, wait_until
from fault_kit.workers import Spawn, worker_env

from models import Scorer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_kill9_twice_mid_stream_loses_nothing(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    rate = 150.0

    async def scenario() -> tuple[Accounting, list[KillReport], Stream]:
        # Open-ended: the stream runs until the second successor has its partitions, however slowly a busy
        # host starts the workers.
        stream = await Stream.open(kafka_bootstrap, "kill9", int(STREAM_CAP_S * rate), rate, open_ended=True)
        # max_wait_ms holds each batch open a little, so that a kill finds requests in flight.
        env = worker_env(
            kafka_bootstrap, tiny_llama_dir, stream.names, max_inflight_requests=MAX_INFLIGHT, max_wait_ms=50
        )
        try:
            worker = spawn("worker-0", env)
            await worker.wait_assigned()
            await stream.produce()
            kills = []
            for round_ in (1, 2):
                kills.append(await kill_when_steady(worker, stream, 300 * round_))
                worker = spawn(f"worker-{round_}", env)
                await worker.wait_assigned()
            acc = await stream.finish([worker])
            return acc, [KillReport.of(stream, at) for at in kills], stream
        finally:
            await stream.close()

    acc, kills, stream = asyncio.run(scenario())
    largest = check_complete(acc, stream, reference)
    bound = duplicate_bound(len(kills), rate)
    at_kills = [(k.answered, k.unanswered) for k in kills]
    figures(
        "kill -9 twice",
        requests=len(stream.requests),
        rate=rate,
        answered_unanswered_at_kills=at_kills,
        duplicates=acc.duplicates,
        duplicate_bound=bound,
        largest_score_diff=f"{largest:.2g}",
    )
    for kill in kills:
        kill.check_mid_stream()
    assert acc.duplicates <= bound


def test_second_worker_joins_under_load_then_the_first_is_killed(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    rate = 120.0

    async def scenario() -> tuple[Accounting, KillReport, float, set[int], Stream]:
        stream = await Stream.open(kafka_bootstrap, "pair", int(STREAM_CAP_S * rate), rate, open_ended=True)
        env = worker_env(
            kafka_bootstrap, tiny_llama_dir, stream.names, max_inflight_requests=MAX_INFLIGHT, max_wait_ms=50
        )
        try:
            first = spawn("first", env)
            await first.wait_assigned()
            await stream.produce()
            await wait_until(lambda: len(stream.watcher.first) >= 200, 60, "200 answers")
            joined = time.time()
            second = spawn("second", env)
            await second.wait_assigned()
            assert stream.running(), "the second worker joined after the stream ended"
            await first.wait_assigned(after=joined)  # the rebalance has reached the first worker too
            taken = second.assigned()
            assert taken and first.assigned() and not taken & first.assigned()
            kill_at = await kill_when_steady(first, stream, len(stream.watcher.first) + 200)
            took_over = await second.wait_for(ALL_FOUR, after=kill_at)
            acc = await stream.finish([second])
            return acc, KillReport.of(stream, kill_at), took_over.at - kill_at, taken, stream
        finally:
            await stream.close()

    acc, kill, takeover_s, taken, stream = asyncio.run(scenario())
    largest = check_complete(acc, stream, reference)
    bound = duplicate_bound(1, rate)
    figures(
        "two workers",
        second_took=sorted(taken),
        answered_unanswered_at_kill=(kill.answered, kill.unanswered),
        kill_to_all_partitions_s=takeover_s,
        duplicates=acc.duplicates,
        duplicate_bound=bound,
        largest_score_diff=f"{largest:.2g}",
    )
    kill.check_mid_stream()
    assert acc.duplicates <= bound


def ids_on(stream: Stream, partitions: set[int]) -> set[str]:
    """Ids of the requests that landed on these partitions (for a stream of one record per request)."""
    placed = stream.producer.placed
    return {r.request_id for r, at in zip(stream.requests, placed, strict=True) if at and at[0] in partitions}


def test_time_to_first_result_at_start_and_after_a_kill(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    rate = 100.0

    async def scenario() -> tuple[StartFigures, StartFigures, Accounting, Stream]:
        stream = await Stream.open(
            kafka_bootstrap, "first-result", int(STREAM_CAP_S * rate), rate, open_ended=True
        )
        # The real start-up, the self-check included.
        env = worker_env(
            kafka_bootstrap, tiny_llama_dir, stream.names, self_check=True, max_inflight_requests=MAX_INFLIGHT
        )
        try:
            await stream.produce()
            first = spawn("first", env)
            cold = await start_figures(first, stream)
            joined = time.time()
            second = spawn("second", env)
            await second.wait_assigned()
            await first.wait_assigned(after=joined)
            owned = first.assigned()
            kill_at = await kill_when_steady(first, stream, len(stream.watcher.first) + 100)
            moved = await second.wait_for(ALL_FOUR, after=kill_at)
            acc = await stream.finish([second])
            taken = stream.watcher.first_after(kill_at, ids_on(stream, owned))
            assert taken is not None, (
                "no request of the killed worker's partitions was answered after the kill"
            )
            return cold, StartFigures(None, moved.at - kill_at, taken - kill_at), acc, stream
        finally:
            await stream.close()

    cold, takeover, acc, stream = asyncio.run(scenario())
    figures(
        "time to first result from the process start (self-check on)",
        loaded_s=cold.loaded_s,
        assigned_s=cold.assigned_s,
        first_result_s=cold.first_result_s,
    )
    figures(
        "time to first result from kill -9 of one of two workers (session timeout 3 s)",
        survivor_assigned_s=takeover.assigned_s,
        first_result_s=takeover.first_result_s,
        duplicates=acc.duplicates,
    )
    check_complete(acc, stream, reference)
    assert acc.duplicates <= duplicate_bound(1, rate)
    assert cold.first_result_s < START_BOUND_S and takeover.first_result_s < START_BOUND_S
