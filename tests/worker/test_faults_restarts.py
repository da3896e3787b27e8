"""A worker process stopped (SIGTERM) or killed and started again under load: its successor finishes the
stream, nothing lost, duplicates bounded (the kills themselves: test_faults.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.kills import (
    MAX_INFLIGHT,
    START_BOUND_S,
    STREAM_CAP_S,
    StartFigures,
    duplicate_bound,
    kill_when_steady,
    start_figures,
)
from fault_kit.traffic import Stream, wait_holding, wait_until
from fault_kit.workers import Spawn, WorkerProcess, worker_env

from models import Scorer
from worker.broker import free_port
from worker.config import WorkerSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_sigterm_under_load_exits_0_promptly_and_a_successor_finishes_without_duplicates(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    exit_bound_s = 10.0

    async def scenario() -> tuple[Accounting, int, float, WorkerProcess, Stream]:
        # Open-ended: on two busy cores the first answers can take several seconds (capped at 120 s).
        stream = await Stream.open(kafka_bootstrap, "sigterm", 24_000, 200.0, open_ended=True)
        # A request that finds the worker idle waits up to 3 s for company: SIGTERM goes when the worker's
        # gauge shows it holding such a batch (see wait_holding). The wait is the window the signal must
        # land in after the scrape that saw the batch: with a 1 s wait, a parallel run on a loaded host
        # once found the worker had answered everything by the time the signal came.
        port = free_port()
        env = worker_env(
            kafka_bootstrap, tiny_llama_dir, stream.names, max_wait_ms=3000, max_batch_requests=1024,
            metrics_port=port, metrics_host="127.0.0.1",
        )  # fmt: skip
        try:
            first = spawn("first", env)
            await first.wait_assigned()
            await stream.produce()
            await wait_until(lambda: len(stream.watcher.first) >= 200, 60, "200 answers")
            await wait_holding(port, 10.0)
            code, seconds = await first.terminate()
            assert stream.running(), "the stream ended before SIGTERM"
            successor = spawn("successor", env)
            await successor.wait_assigned()
            acc = await stream.finish([successor])
            return acc, code, seconds, first, stream
        finally:
            await stream.close()

    acc, code, seconds, first, stream = asyncio.run(scenario())
    stop = first.find(r"stop requested: (\d+)")
    figures(
        "SIGTERM",
        exit_code=code,
        sigterm_to_exit_s=seconds,
        in_flight=stop and stop.message,
        duplicates=acc.duplicates,
    )
    assert code == 0, first.tail()
    assert seconds < exit_bound_s
    assert stop is not None and not stop.message.startswith("stop requested: 0 "), "nothing was in flight"
    check_complete(acc, stream, reference)
    assert acc.duplicates == 0, [rid for rid, n in acc.counts.items() if n > 1][:10]


def test_static_membership_restart_after_kill9(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    if "group_instance_id" not in WorkerSettings.model_fields:
        pytest.skip("no SCORE_WORKER_GROUP_INSTANCE_ID setting in this worker: static membership not tried")
    rate = 120.0

    async def scenario() -> tuple[float, StartFigures, Accounting, Stream]:
        stream = await Stream.open(kafka_bootstrap, "static", int(STREAM_CAP_S * rate), rate, open_ended=True)
        # The session must outlast the restart (imports alone take seconds) for the member to be kept.
        env = worker_env(
            kafka_bootstrap,
            tiny_llama_dir,
            stream.names,
            group_instance_id="static-0",
            session_timeout_ms=10_000,
            heartbeat_interval_ms=1000,
            max_inflight_requests=MAX_INFLIGHT,
        )
        try:
            worker = spawn("static-0", env)
            # The first join waits about half the (longer) session timeout: the stream starts after it.
            joined = (await worker.wait_assigned()).at - worker.started_at
            await stream.produce()
            await kill_when_steady(worker, stream, 300)
            again = spawn("static-0-again", env)
            restart = await start_figures(again, stream)
            acc = await stream.finish([again])
            return joined, restart, acc, stream
        finally:
            await stream.close()

    joined, restart, acc, stream = asyncio.run(scenario())
    figures(
        "static membership (session timeout 10 s)",
        first_join_s=joined,
        restart_loaded_s=restart.loaded_s,
        restart_assigned_s=restart.assigned_s,
        restart_first_result_s=restart.first_result_s,
        duplicates=acc.duplicates,
    )
    check_complete(acc, stream, reference)
    assert acc.duplicates <= duplicate_bound(1, rate)
    assert restart.first_result_s < START_BOUND_S
