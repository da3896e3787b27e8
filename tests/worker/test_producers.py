"""Clients nobody here wrote are peers: confluent-kafka (librdkafka) producers under every compression codec
Kafka defines, with both of librdkafka's default partitioners, keyed and null-keyed records, the contract's
headers and unknown ones, invalid requests among valid ones; a confluent-kafka consumer group reads the
results and the dead-letter topic. One worker process answers it all, each request once, and keeps its PID.

The project's own writers (the worker's results producer, ScoreClient) write every codec too, and their
readers (ScoreClient, the lag exporter) get past a batch they cannot read."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import raw_batches
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition
from brokers import BrokerPool, broker_tiers
from confluent_kafka import Consumer, Producer
from fault_kit.accounting import Accounting, spot_check
from fault_kit.poison import Poison, check_poison, poison_corpus
from fault_kit.traffic import create_topics, make_requests
from fault_kit.workers import Spawn, worker_env
from worker_testkit import Names, client_kwargs, fast_settings, request_record

from models import Scorer, ScorerConfig
from schemas import ErrorCode, ResultStatus, ScoreRequest, ScoreResult, decode_result, encode_result
from worker.app import ScoreWorker
from worker.client import ScoreClient
from worker.codecs import CODEC_NAMES
from worker.lag_exporter import LagExporter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Real producers' batches as both Kafka versions store and serve them.
kafka_bootstrap = broker_tiers("default", "kafka-compose")

PARTITIONS = 4
# librdkafka's partitioners for keyed records: CRC32 of the key (its default), and the Java client's murmur2.
# Null-keyed records go to a random partition under both.
PARTITIONERS = ("consistent_random", "murmur2_random")
PER_PRODUCER = 12
# Headers no contract names, among the contract's: a binary value, a null value, an upper-case name.
UNKNOWN_HEADERS = [("x-trace-state", b"\x00\xff\x10"), ("x-empty", None), ("X-Origin", b"librdkafka")]
# Small enough to compress together and stay quick; the large poison records have their own test.
SMALL_POISON_BYTES = 8192


def read_with_a_group(
    bootstrap: str, topics: list[str], expected: int, timeout_s: float = 120.0
) -> list[Any]:
    """Records of `topics` read by a confluent-kafka consumer group until `expected` came (then a second
    more, to catch extras)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"peer-reader-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            # The embedded broker makes a joining member wait half the session timeout.
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
        }
    )
    consumer.subscribe(topics)
    records: list[Any] = []
    deadline, settle = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < (settle or deadline):
            message = consumer.poll(0.2)
            if message is None:
                continue
            assert message.error() is None, message.error()
            records.append(message)
            if settle is None and len(records) >= expected:
                settle = time.monotonic() + 1.0
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return records


def test_confluent_kafka_producers_under_every_codec_are_answered_once_each(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    names = Names.unique("peers")
    asyncio.run(create_topics(kafka_bootstrap, names, PARTITIONS))
    requests = make_requests(names.group, len(CODEC_NAMES) * len(PARTITIONERS) * PER_PRODUCER)
    poisons = [p for p in poison_corpus(names.group) if len(p.record[1] or b"") <= SMALL_POISON_BYTES]
    worker = spawn("worker", worker_env(kafka_bootstrap, tiny_llama_dir, names, max_record_bytes=65536))
    asyncio.run(worker.wait_assigned())
    pid = worker.pid

    placed: dict[tuple[int, int], Poison] = {}
    failures: list[str] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            failures.append(str(error))

    producers = [(codec, partitioner) for codec in CODEC_NAMES for partitioner in PARTITIONERS]
    for n, (codec, partitioner) in enumerate(producers):
        producer = Producer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "compression.type": codec,
                "partitioner": partitioner,
                "linger.ms": 20,
                "acks": "all",
            }
        )
        for i, request in enumerate(requests[n * PER_PRODUCER : (n + 1) * PER_PRODUCER]):
            key, value, headers = request_record(request)
            producer.produce(
                names.requests, value=value, key=key if i % 2 else None, headers=[*headers, *UNKNOWN_HEADERS],
                on_delivery=delivered,
            )  # fmt: skip
        for poison in poisons[n :: len(producers)]:
            key, value, headers = poison.record

            def placed_at(error: Any, message: Any, poison: Poison = poison) -> None:
                if error is not None:
                    failures.append(str(error))
                else:
                    placed[(message.partition(), message.offset())] = poison

            producer.produce(names.requests, value=value, key=key, headers=headers, on_delivery=placed_at)
        assert producer.flush(30) == 0
    assert not failures, failures
    assert len(placed) == len(poisons)
    # Every codec really reached the broker as such (a producer may leave a batch uncompressed when that
    # is smaller, so each codec must be among what is stored, not alone).
    assert set(raw_batches.stored_codecs(kafka_bootstrap, names.requests, PARTITIONS)) == set(CODEC_NAMES)

    answered = [p.result_id for p in poisons if p.result_id is not None]
    letters = sum(p.dead_letter for p in poisons)
    records = read_with_a_group(
        kafka_bootstrap, [names.results, names.dlq], len(requests) + len(answered) + letters
    )
    by_id: dict[str, list[ScoreResult]] = {}
    dead = []
    for message in records:
        if message.topic() == names.dlq:
            dead.append(SimpleNamespace(headers=message.headers() or [], value=message.value()))
            continue
        result = decode_result(message.value())
        by_id.setdefault(result.request_id, []).append(result)
    expected = Counter({r.request_id: 1 for r in requests}) + Counter(answered)
    acc = Accounting(Counter({rid: len(got) for rid, got in by_id.items()}), expected, by_id)
    assert not acc.missing and not acc.unexpected and acc.duplicates == 0, (acc.missing, acc.unexpected)
    assert not acc.not_ok({r.request_id for r in requests})
    spot_check(reference, requests, acc, size=len(requests))
    check_poison(acc, dead, placed)
    assert worker.running() and worker.pid == pid, worker.tail()
    # The worker's own batches are zstd (results_compression's default), and the peer read them.
    assert set(raw_batches.stored_codecs(kafka_bootstrap, names.results, PARTITIONS)) == {"zstd"}


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_the_projects_writers_write_every_codec(
    kafka_bootstrap: str, tiny_llama_dir: Path, codec: str
) -> None:
    """ScoreClient sends its requests, and the worker its results, compressed with `codec`; both read."""

    async def scenario() -> None:
        names = Names.unique(f"codec-{codec}")
        await create_topics(kafka_bootstrap, names, 2)
        settings = fast_settings(
            kafka_bootstrap, tiny_llama_dir, names, create_topics=False, self_check=False,
            results_compression=codec,
        )  # fmt: skip
        scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        requests = make_requests(names.group, 12)
        try:
            async with ScoreClient(
                kafka_bootstrap, requests_topic=names.requests, results_topic=names.results, compression=codec
            ) as client:
                results = await client.score(requests, timeout=90)
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
        assert [r.request_id for r in results] == [r.request_id for r in requests]
        assert all(r.status is ResultStatus.OK for r in results)
        for got, want in zip(results, scorer.score(requests), strict=True):
            assert got.scores == want.scores  # the same float32 scorer on the same batch
        return names

    names = asyncio.run(scenario())
    for topic in (names.requests, names.results):
        assert set(raw_batches.stored_codecs(kafka_bootstrap, topic, 2)) == {codec}, topic


def test_readers_get_past_a_results_batch_they_cannot_read(broker_pool: BrokerPool, tmp_path: Path) -> None:
    """A damaged batch on the results topic: ScoreClient resolves the results around it and counts the ones
    in it (their requests stay unanswered); the lag exporter still reports the end of a partition whose last
    batch is damaged. On the embedded broker, which stores the damaged batch as given (Apache Kafka refuses
    it at produce time)."""
    kafka_bootstrap = broker_pool.embedded().bootstrap

    def result_records(ids: list[str]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
        return [
            (rid.encode(), encode_result(ScoreResult.failure(rid, ErrorCode.EXPIRED, "late")), [])
            for rid in ids
        ]

    async def scenario() -> None:
        names = Names.unique("unreadable-results")
        await create_topics(kafka_bootstrap, names, 1)
        requests = [ScoreRequest(f"{names.group}-{i}", items=("x",)) for i in range(6)]
        before, inside, after = requests[:2], requests[2:4], requests[4:]
        tp = TopicPartition(names.results, 0)
        async with ScoreClient(
            kafka_bootstrap, requests_topic=names.requests, results_topic=names.results
        ) as client:
            futures = {r.request_id: await client.submit(r) for r in requests}
            # No worker: the test writes the results itself, the middle two in a damaged batch.
            producer = AIOKafkaProducer(**client_kwargs(kafka_bootstrap))
            await producer.start()
            try:
                for key, value, headers in result_records([r.request_id for r in before]):
                    await producer.send_and_wait(names.results, value, key=key, headers=headers, partition=0)
                damaged = raw_batches.crc_damaged(result_records([r.request_id for r in inside]))
                await raw_batches.produce_raw(kafka_bootstrap, tp, damaged)
                for key, value, headers in result_records([r.request_id for r in after]):
                    await producer.send_and_wait(names.results, value, key=key, headers=headers, partition=0)
            finally:
                await producer.stop()
            for request in before + after:
                result = await asyncio.wait_for(futures[request.request_id], 30)
                assert result.error is not None and result.error.code is ErrorCode.EXPIRED
            assert client.stats.unreadable == len(inside)
            assert not any(futures[r.request_id].done() for r in inside)
        # The exporter fetches the last record of each partition: let that be in a damaged batch.
        await raw_batches.produce_raw(kafka_bootstrap, tp, damaged)
        exporter = LagExporter(kafka_bootstrap, [names.group], [names.results], 1.0)
        await exporter.start()
        try:
            await exporter.poll()
            labels = {"topic": names.results, "partition": "0"}
            end = exporter.metrics.registry.get_sample_value("score_worker_topic_high_water_mark", labels)
        finally:
            await exporter.stop()
        assert end == len(requests) + len(inside)

    asyncio.run(scenario())
