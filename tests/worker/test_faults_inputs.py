"""Faults in what reaches a worker process: its broker connection cut, poison records among good ones, the
largest requests its limits allow; nothing lost, and its memory back near idle afterwards."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from brokers import OwnBroker
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.kills import (
    MAX_INFLIGHT,
    STREAM_CAP_S,
    duplicate_bound,
)
from fault_kit.poison import Poison, check_poison, poison_corpus
from fault_kit.proxy import ClientCutProxy
from fault_kit.traffic import Stream, wait_until
from fault_kit.workers import RssSampler, Spawn, WorkerProcess, worker_env
from worker_testkit import read_topic, request_record

from models import Scorer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


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
