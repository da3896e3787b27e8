"""Faults against real worker processes and a real broker: nothing lost, duplicates bounded, results right."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from brokers import OwnBroker
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.poison import Poison, check_poison, poison_corpus
from fault_kit.proxy import ClientCutProxy
from fault_kit.traffic import Stream, wait_holding, wait_until
from fault_kit.workers import RssSampler, Spawn, WorkerProcess, worker_env
from worker_testkit import read_topic, request_record

from models import Scorer
from worker.broker import free_port
from worker.config import WorkerSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

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


def test_sigterm_under_load_exits_0_promptly_and_a_successor_finishes_without_duplicates(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    exit_bound_s = 10.0

    async def scenario() -> tuple[Accounting, int, float, WorkerProcess, Stream]:
        # Open-ended: on two busy cores the first answers can take several seconds (capped at 120 s).
        stream = await Stream.open(kafka_bootstrap, "sigterm", 24_000, 200.0, open_ended=True)
        # A request that finds the worker idle waits up to a second for company: SIGTERM goes when the
        # worker's gauge shows it holding such a batch (see wait_holding).
        port = free_port()
        env = worker_env(
            kafka_bootstrap, tiny_llama_dir, stream.names, max_wait_ms=1000, max_batch_requests=256,
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


def test_cut_broker_connection_for_10_s_loses_nothing_and_the_worker_keeps_running(
    tiny_llama_dir: Path, spawn: Spawn, reference: Scorer, own_broker: Callable[..., OwnBroker]
) -> None:
    outage_s, rate = 10.0, 120.0
    # The broker advertises the proxy, so every client goes through it; only the worker's connections, told
    # apart by their client id, are cut, while the test's producer and readers keep going.
    proxy = ClientCutProxy(cut_prefix="faulty-worker").start()
    try:
        broker = own_broker(advertised=("127.0.0.1", proxy.port))
        proxy.upstream_port = broker.listen_port
        outcome = asyncio.run(_cut_scenario(proxy, broker, tiny_llama_dir, spawn, outage_s, rate))
    finally:
        proxy.stop()
    acc, worker, cut_at, restore_at, stream = outcome
    largest = check_complete(acc, stream, reference)
    during, after = worker.problems(cut_at, restore_at), worker.problems(restore_at, math.inf)
    figures(
        "connection cut",
        outage_s=outage_s,
        severed=proxy.severed,
        refused=proxy.refused,
        same_pid_running=worker.running(),
        warning_error_lines_during=len(during),
        warning_error_lines_after=len(after),
        duplicates=acc.duplicates,
        largest_score_diff=f"{largest:.2g}",
    )
    for line in during + after:
        print(f"  {line.level} {line.message[:160]}")
    assert proxy.severed > 0, "the cut closed no connection of the worker"
    assert worker.running(), worker.tail()
    assert acc.duplicates <= duplicate_bound(1, rate, pace=1.0)


async def _cut_scenario(
    proxy: ClientCutProxy, broker: OwnBroker, model_dir: Path, spawn: Spawn, outage_s: float, rate: float
) -> tuple[Accounting, WorkerProcess, float, float, Stream]:
    direct = f"127.0.0.1:{broker.listen_port}"
    stream = await Stream.open(direct, "cut", int(STREAM_CAP_S * rate), rate, open_ended=True)
    env = worker_env(
        f"127.0.0.1:{proxy.port}",
        model_dir,
        stream.names,
        client_id="faulty-worker",
        max_inflight_requests=MAX_INFLIGHT,
    )
    try:
        worker = spawn("worker", env)
        await worker.wait_assigned()
        await stream.produce()
        await wait_until(lambda: len(stream.watcher.first) >= 300, 60, "300 answers")
        cut_at = time.time()
        proxy.cut()
        await asyncio.sleep(outage_s)
        proxy.restore()
        restore_at = time.time()
        assert stream.running(), "the stream ended during the outage"
        acc = await stream.finish([worker])
        # A result stamped well inside the outage would mean the cut let the worker through.
        resumed = stream.watcher.first_after(cut_at + 1)
        assert resumed is not None and resumed > restore_at, (
            "a result was published while the worker was cut off"
        )
        print(f"\n  first result {resumed - restore_at:.2f} s after the connection came back")
        return acc, worker, cut_at, restore_at, stream
    finally:
        await stream.close()


# keyless-oversized: the dead-letter copy of a keyless record above max_record_bytes once had neither key
# nor value; the client refused it and the worker stopped on it at every restart.
@pytest.mark.parametrize("keyless_oversized", [False, True], ids=["keyed", "keyless-oversized"])
def test_poison_records_interleaved_with_good_ones(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer, keyless_oversized: bool
) -> None:
    growth_bound_mib = 100  # measured: +55 to +65 MiB, the first forward passes included
    poisons: list[Poison] = []
    duplicated: list[str] = []

    def mix(requests: list[Any]) -> list[Any]:
        poisons.extend(poison_corpus(requests[0].request_id.rsplit("-", 1)[0], keyless_oversized))
        records = [request_record(r) for r in requests]
        # Sent again later under the same id: two live requests with one id, both answered.
        for index in (10, 500, 1500):
            duplicated.append(requests[index].request_id)
            records.insert(index + 300, request_record(requests[index]))
        step = len(records) // (len(poisons) + 1)
        for n, poison in enumerate(poisons, start=1):
            records.insert(n * step + n - 1, poison.record)
        return records

    async def scenario() -> tuple[Accounting, list[Any], int, int, Stream]:
        stream = await Stream.open(kafka_bootstrap, "poison", 2000, 300.0, mix=mix)
        env = worker_env(kafka_bootstrap, tiny_llama_dir, stream.names, max_record_bytes=65536)
        try:
            worker = spawn("worker", env)
            await worker.wait_assigned()
            idle_sampler = RssSampler(worker).start()
            await asyncio.sleep(1.0)
            idle = idle_sampler.stop()
            sampler = RssSampler(worker).start()
            await stream.produce()
            extra = Counter(duplicated)
            extra.update(p.result_id for p in poisons if p.result_id is not None)
            acc = await stream.finish([worker], extra=extra)
            peak = sampler.stop()
            dead = await read_topic(kafka_bootstrap, stream.names.dlq, sum(p.dead_letter for p in poisons))
            return acc, dead, idle, peak, stream
        finally:
            await stream.close()

    acc, dead, idle, peak, stream = asyncio.run(scenario())
    index_of = {id(record): i for i, record in enumerate(stream.producer.records)}
    placed = {stream.producer.placed[index_of[id(p.record)]]: p for p in poisons}
    figures(
        "poison",
        bad_records=len(poisons),
        good_requests=len(stream.requests),
        duplicate_ids=len(duplicated),
        dead_letters=len(dead),
        rss_idle_mib=idle // 1024,
        rss_peak_mib=peak // 1024,
        rss_growth_mib=(peak - idle) // 1024,
        rss_growth_bound_mib=growth_bound_mib,
    )
    check_complete(acc, stream, reference)
    assert acc.duplicates == 0
    assert all(acc.counts[rid] == 2 for rid in duplicated)
    check_poison(acc, dead, placed)
    assert peak < idle + growth_bound_mib * 1024


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


def test_resident_memory_falls_back_after_the_largest_allowed_requests(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn
) -> None:
    """Two requests at the default limits (262,144 tokens each, hidden states for every item) raise the
    worker's memory for as long as they run, and it returns near its idle level afterwards."""
    from worker_testkit import Names, fast_settings, produce

    from schemas import HiddenDType, ResultStatus, ScoreRequest, decode_result
    from worker.topics import ensure_topics

    growth_bound_mib, after_bound_mib = 150, 40  # measured: +47 MiB at the peak, +4 MiB after
    names = Names.unique("memory")
    largest = [
        ScoreRequest(
            f"largest-{n}",
            items=tuple(tuple(3 + (i + j + n) % 90 for j in range(500)) for i in range(524)),
            return_pooled_hidden_states=True,
            hidden_states_dtype=HiddenDType.FLOAT32,
        )
        for n in range(2)
    ]
    assert sum(len(item) for item in largest[0].items) <= 262_144
    warm = [ScoreRequest(f"warm-{i}", items=(f"text {i}",) * 4) for i in range(40)]

    async def scenario() -> tuple[int, int, int, list[Any]]:
        await ensure_topics(fast_settings(kafka_bootstrap, tiny_llama_dir, names, topic_partitions=1))
        worker = spawn(
            "worker", worker_env(kafka_bootstrap, tiny_llama_dir, names, max_record_bytes=4_000_000)
        )
        await worker.wait_assigned()
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in warm])
        await read_topic(kafka_bootstrap, names.results, len(warm), settle_s=0.5)
        idle = RssSampler(worker).start()
        await asyncio.sleep(1.0)
        idle_kib = idle.stop()
        sampler = RssSampler(worker).start()
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in largest])
        results = await read_topic(kafka_bootstrap, names.results, len(warm) + 2, timeout_s=120, settle_s=0)
        peak_kib = sampler.stop()
        await asyncio.sleep(2.0)
        after = RssSampler(worker).start()
        await asyncio.sleep(1.0)
        return idle_kib, peak_kib, after.stop(), results

    idle, peak, after, results = asyncio.run(scenario())
    answers = {decode_result(r.value).request_id: decode_result(r.value) for r in results}
    figures(
        "memory",
        rss_idle_mib=idle // 1024,
        rss_peak_mib=peak // 1024,
        rss_after_mib=after // 1024,
        growth_bound_mib=growth_bound_mib,
        after_bound_mib=after_bound_mib,
    )
    for request in largest:
        answer = answers[request.request_id]
        assert answer.status is ResultStatus.OK and len(answer.scores) == 524, answer.error
    assert peak < idle + growth_bound_mib * 1024
    assert after < idle + after_bound_mib * 1024
