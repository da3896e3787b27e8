"""Exactly-once delivery (delivery=exactly-once) on a broker with transactions (Apache Kafka).

Read back with isolation.level=read_committed, every request is answered once: through a worker's
kill -9 mid-stream, a rebalance as workers join and leave, and a stale worker fenced by the partition's
new owner. The broker-failure case runs with the three-node cluster in test_broker_failures.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition
from brokers import BrokerPool, not_here
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.traffic import Stream, create_topics, wait_until
from fault_kit.workers import Spawn, worker_env
from prometheus_client import CollectorRegistry
from worker_testkit import Names, client_kwargs, committed_offsets, fast_settings, read_topic

from models import Scorer
from schemas import ResultStatus, ScoreResult, decode_result
from worker.config import WorkerSettings
from worker.errors import PublishError
from worker.intake import Outgoing
from worker.metrics import ResultTally, WorkerMetrics
from worker.publisher import broker_grants_producer_ids, result_record
from worker.sink import Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_INFLIGHT = 64
ALL_FOUR = r"assigned partitions: \[.*\[0\].*\[1\].*\[2\].*\[3\]"


@pytest.fixture
def eos_bootstrap(kafka_bootstrap: str) -> str:
    """The suite's broker, where it has transactions (Apache Kafka does; the embedded broker does not)."""
    if not asyncio.run(broker_grants_producer_ids(client_kwargs(kafka_bootstrap), timeout_s=30)):
        not_here("exactly-once needs a broker with transactions; this one grants no producer ids")
    return kafka_bootstrap


def _sink(settings: WorkerSettings, fenced: list[TopicPartition] | None = None) -> Sink:
    metrics = WorkerMetrics(settings.worker_id, registry=CollectorRegistry())
    return Sink(settings, metrics, None if fenced is None else fenced.append)


async def _never_commit(offsets: dict[TopicPartition, int]) -> None:
    raise AssertionError(f"exactly-once must commit in transactions, not with the consumer: {offsets}")


def _answer(settings: WorkerSettings, tp: TopicPartition, offset: int, request_id: str) -> Outgoing:
    result = ScoreResult(request_id, ResultStatus.OK, scores=((float(offset),),))
    record = result_record(settings, None, result)
    tally = ResultTally()
    tally.add(record, 0)
    return Outgoing([record], tally, [(tp, offset)])


def test_answers_wait_for_the_requests_before_them_and_a_fenced_owner_writes_nothing(
    eos_bootstrap: str, tmp_path: Path
) -> None:
    """Offset 1 answered before offset 0: nothing is written until 0 is answered too, then both in one
    transaction with the offset past them. A second owner of the partition fences the first: the first's
    answers never become visible, and the committed offset is the second's."""

    async def scenario() -> tuple[list[str], dict[int, int], list[TopicPartition], int]:
        names = Names.unique("eos-fence")
        await create_topics(eos_bootstrap, names, partitions=1)
        settings = fast_settings(eos_bootstrap, tmp_path, names, delivery="exactly-once")
        tp = TopicPartition(names.requests, 0)
        fenced: list[TopicPartition] = []
        first, second = _sink(settings, fenced), _sink(settings)
        await first.start(_never_commit)
        await first.open([tp])
        first.activate([tp])
        for offset in (0, 1, 2):
            assert first.track(tp, offset)
        later = asyncio.create_task(first.deliver(_answer(settings, tp, 1, "first-1")))
        await asyncio.sleep(1.0)
        assert not later.done(), "an answer was written before the request ahead of it was answered"
        assert first.pending([tp]) == 3  # two open, one held
        await first.deliver(_answer(settings, tp, 0, "first-0"))
        await asyncio.wait_for(later, 30)
        assert first.pending([tp]) == 1
        # A new owner takes the partition over (the first is now a zombie: say, stalled past its session).
        await second.start(_never_commit)
        await second.open([tp])
        second.activate([tp])
        await first.deliver(_answer(settings, tp, 2, "zombie-2"))  # fenced: returns, nothing written
        assert second.track(tp, 2)
        await second.deliver(_answer(settings, tp, 2, "second-2"))
        await first.stop()
        await second.stop()
        records = await read_topic(
            eos_bootstrap, names.results, 3, timeout_s=10, settle_s=1.0, isolation_level="read_committed"
        )
        everything = await read_topic(eos_bootstrap, names.results, 4, timeout_s=5, settle_s=0.5)
        committed = await committed_offsets(eos_bootstrap, names.group, names.requests)
        ids = [decode_result(r.value or b"").request_id for r in records]
        return ids, committed, fenced, len(everything)

    ids, committed, fenced, everything = asyncio.run(scenario())
    assert ids == ["first-0", "first-1", "second-2"]
    assert committed == {0: 3}
    assert len(fenced) == 1
    # The zombie's answer may have reached the log before its transaction was refused: never committed.
    assert everything in (3, 4)


def test_exactly_once_is_refused_where_the_broker_has_no_transactions(
    broker_pool: BrokerPool, tmp_path: Path
) -> None:
    bootstrap = broker_pool.embedded().bootstrap
    settings = fast_settings(bootstrap, tmp_path, Names.unique("eos-embedded"), delivery="exactly-once")

    async def start() -> None:
        await _sink(settings).start(_never_commit)

    with pytest.raises(PublishError, match="needs a broker with transactions"):
        asyncio.run(start())


def test_kill9_and_rebalances_under_exactly_once_answer_every_request_once(
    eos_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    """One worker; a second joins (a rebalance); the first is killed mid-stream (its open transactions
    are aborted when the second takes its partitions over); a third joins. Read with read_committed:
    every request answered once."""
    rate = 100.0

    async def scenario() -> tuple[Accounting, Stream, int, dict[int, int], dict[str, float]]:
        stream = await Stream.open(
            eos_bootstrap,
            "eos",
            int(200 * rate),
            rate,
            idempotent=True,
            isolation_level="read_committed",
            open_ended=True,
        )
        env = worker_env(
            eos_bootstrap, tiny_llama_dir, stream.names, delivery="exactly-once",
            max_inflight_requests=MAX_INFLIGHT, max_wait_ms=50,
        )  # fmt: skip
        try:
            first = spawn("first", env)
            await first.wait_assigned(timeout_s=120)
            await stream.produce()
            await wait_until(lambda: len(stream.watcher.first) >= 300, 90, "300 answers")
            joined = time.time()
            second = spawn("second", env)
            await second.wait_assigned(timeout_s=120)
            await first.wait_assigned(after=joined)
            assert first.assigned() and second.assigned(), "the rebalance did not split the partitions"
            answered = len(stream.watcher.first)
            await wait_until(lambda: len(stream.watcher.first) >= answered + 300, 90, "300 more answers")
            assert stream.running(), "the stream ended before the kill"
            kill_at = first.kill()
            took_over = await second.wait_for(ALL_FOUR, after=kill_at, timeout_s=90)
            third = spawn("third", env)
            await third.wait_assigned(timeout_s=120)
            acc = await stream.finish([second, third], timeout_s=120)
            everything = await read_topic(
                eos_bootstrap, stream.names.results, len(stream.requests), timeout_s=10, settle_s=1.0
            )
            committed = await committed_offsets(eos_bootstrap, stream.names.group, stream.names.requests)
            timings = {"kill_to_all_partitions_s": took_over.at - kill_at}
            return acc, stream, len(everything), committed, timings
        finally:
            await stream.close()

    acc, stream, everything, committed, timings = asyncio.run(scenario())
    largest = check_complete(acc, stream, reference)
    log_end: dict[int, int] = {}
    for where in stream.producer.placed:
        assert where is not None
        log_end[where[0]] = max(log_end.get(where[0], 0), where[1] + 1)
    figures(
        "exactly-once kill -9 and rebalances",
        requests=len(stream.requests),
        rate=rate,
        duplicates=acc.duplicates,
        uncommitted_records_in_log=everything - sum(acc.counts.values()),
        largest_score_diff=f"{largest:.2g}",
        **timings,
    )
    assert acc.duplicates == 0, f"{acc.duplicates} requests answered twice under exactly-once"
    assert committed == log_end, f"committed {committed}, log end {log_end}"
