"""Record building: whatever a request carries, its result and dead-letter copy fit the record limit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import UnknownTopicOrPartitionError
from aiokafka.structs import ConsumerRecord, TopicPartition
from brokers import BrokerPool
from worker_testkit import Names, fast_settings, read_topic

from schemas import ErrorCode, ResultStatus, ScoreResult, decode_result
from worker.config import WorkerSettings
from worker.publisher import (
    OutRecord,
    Publisher,
    dead_letter_record,
    record_size,
    result_record,
    unreadable_record,
)
from worker.replies import Route
from worker.topics import ensure_topics

FLOOR = WorkerSettings.model_fields["max_record_bytes"].metadata[0].ge
# Error messages may quote what the request sent; four-byte characters make the most bytes of a length.
HOSTILE_MESSAGE = "\N{GRINNING FACE}" * 5000


def _settings(tmp_path: Path) -> WorkerSettings:
    return WorkerSettings(
        bootstrap_servers="127.0.0.1:9092",
        model_dir=tmp_path,
        dlq_topic="d" * 249,
        max_record_bytes=FLOOR,
    )


def test_an_error_result_fits_the_smallest_limit_whatever_was_echoed(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    failure = ScoreResult.failure(
        "r" * 256, ErrorCode.INVALID_REQUEST, HOSTILE_MESSAGE, model="some-model", metadata="m" * 10_000
    )
    record = result_record(settings, b"k" * 10_000, failure)
    assert record_size(record.key, record.value, record.headers) <= FLOOR
    assert record.value is not None
    result = decode_result(record.value)
    assert result.request_id == "r" * 256
    assert result.error is not None and result.error.code == ErrorCode.RESULT_TOO_LARGE


def test_a_dead_letter_copy_fits_the_smallest_limit_whatever_the_record_carries(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    source = ConsumerRecord(
        topic="s" * 249,
        partition=7,
        offset=123_456_789,
        timestamp=0,
        timestamp_type=0,
        key=b"k" * 10_000,
        value=b"v" * 10_000,
        checksum=None,
        serialized_key_size=10_000,
        serialized_value_size=10_000,
        headers=[("trace", b"t" * 10_000)],
    )
    record = dead_letter_record(settings, source, ErrorCode.MALFORMED_MESSAGE, HOSTILE_MESSAGE)
    assert record_size(record.key, record.value, record.headers) <= FLOOR
    headers = dict(record.headers)
    assert headers["x-error-code"] == b"MALFORMED_MESSAGE"
    assert headers["x-source-offset"] == b"123456789"
    message = headers["x-error-message"].decode("utf-8")  # shortened on a character boundary
    assert 0 < len(message.encode()) <= 1000 and HOSTILE_MESSAGE.startswith(message)


def test_a_small_copy_stays_whole(tmp_path: Path) -> None:
    source = ConsumerRecord("src", 0, 5, 0, 0, b"key", b"\xc1 junk", None, 3, 6, [("trace", b"abc")])
    record = dead_letter_record(_settings(tmp_path), source, ErrorCode.MALFORMED_MESSAGE, "not msgpack")
    assert (record.key, record.value) == (b"key", b"\xc1 junk")
    assert record.headers[0] == ("trace", b"abc")
    assert dict(record.headers)["x-source-topic"] == b"src"


class StandInProducer:
    """What Publisher uses of aiokafka's producer: send (refusing topics the 'brokers' lack) and metadata."""

    def __init__(self, topics: set[str]) -> None:
        self.topics = topics
        self.sent: list[str] = []
        self.metadata_reads = 0
        self.client = self

    async def fetch_all_metadata(self) -> Any:
        self.metadata_reads += 1
        return SimpleNamespace(topics=lambda: set(self.topics))

    async def send(self, topic: str, value: Any, key: Any, headers: Any) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if topic in self.topics:
            self.sent.append(topic)
            future.set_result(None)
        else:
            future.set_exception(UnknownTopicOrPartitionError())
        return future


def _reply(settings: WorkerSettings, rid: str, topic: str) -> OutRecord:
    result = ScoreResult(rid, ResultStatus.OK, scores=((0.5,),), prompt_tokens=3, model="m")
    return result_record(settings, rid.encode(), result, Route(topic=topic))


def test_a_result_for_a_reply_topic_the_brokers_lack_becomes_an_error_on_the_results_topic(
    tmp_path: Path,
) -> None:
    settings = WorkerSettings(bootstrap_servers="127.0.0.1:9092", model_dir=tmp_path)
    producer = StandInProducer({settings.results_topic, "score.results.a"})

    async def scenario() -> Any:
        publisher = Publisher(settings)  # not started: the stand-in is its producer
        publisher._producer = producer  # type: ignore[assignment]
        first = await publisher.deliver(
            [_reply(settings, "r1", "score.results.a"), _reply(settings, "r2", "score.results.b")]
        )
        reads = producer.metadata_reads
        again = await publisher.deliver([_reply(settings, "r3", "score.results.a")])  # known: not asked again
        assert producer.metadata_reads == reads
        # Deleted after it was checked: the failed send re-checks and answers on the results topic.
        producer.topics.discard("score.results.a")
        late = await publisher.deliver([_reply(settings, "r4", "score.results.a")])
        return first, again, late

    first, again, late = asyncio.run(scenario())
    assert producer.sent == [
        "score.results.a",
        settings.results_topic,
        "score.results.a",
        settings.results_topic,
    ]
    assert again == [] and len(first) == 1 and len(late) == 1
    for sent, instead_of in (*first, *late):
        assert sent.topic == settings.results_topic and instead_of.topic.startswith("score.results.")
        result = decode_result(sent.value or b"")
        assert result.error is not None and result.error.code is ErrorCode.REPLY_TOPIC_NOT_ALLOWED
        assert "does not exist" in result.error.message


def test_a_batch_of_results_shares_one_produce_request_without_lingering(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The producer does not linger by default: a batch's results are handed over in one go, so they still
    travel together, and a lone result is not held back."""
    names = Names.unique("publish")
    settings = fast_settings(kafka_bootstrap, tmp_path, names, topic_partitions=1)
    assert settings.publish_linger_ms == 0
    records = [_reply(settings, f"r{i}", settings.results_topic) for i in range(50)]
    first = _reply(settings, "first", settings.results_topic)

    async def scenario() -> int:
        await ensure_topics(settings)
        publisher = Publisher(settings)
        await publisher.start()
        producer = publisher._started()
        assert producer._message_accumulator._linger_time == 0  # the setting reaches aiokafka
        # A new topic's partition may answer NOT_LEADER for a moment after its creation (the broker is still
        # taking the leadership it was given) and the producer rightly retries; one delivery first lets the
        # count below see only the batch.
        assert await publisher.deliver([first]) == []
        client = producer.client
        produce_requests = 0
        send = client.send

        async def counting(node_id: int, request: Any, **kwargs: Any) -> Any:
            nonlocal produce_requests
            produce_requests += type(request).__name__.startswith("ProduceRequest")
            return await send(node_id, request, **kwargs)

        client.send = counting  # type: ignore[method-assign]
        try:
            assert await publisher.deliver(records) == []
        finally:
            await publisher.stop()
        return produce_requests

    assert asyncio.run(scenario()) == 1
    read = asyncio.run(read_topic(kafka_bootstrap, settings.results_topic, len(records) + 1, settle_s=0.2))
    assert sorted(decode_result(r.value).request_id for r in read) == sorted(
        ["first"] + [f"r{i}" for i in range(50)]
    )


def test_a_skipped_range_keeps_its_batch_within_the_limit_and_its_range_and_reason_always(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    tp = TopicPartition("s" * 249, 3)
    small = unreadable_record(settings, tp, 17, 21, "codec_unavailable", "batch 17-21 is lz4", b"batch")
    headers = dict(small.headers)
    assert small.key is None and small.value == b"batch" and small.topic == settings.dlq_topic
    assert headers["x-error-code"] == b"UNDECODABLE_RECORDS"
    assert (headers["x-source-offset"], headers["x-source-last-offset"]) == (b"17", b"21")
    assert headers["x-source-partition"] == b"3" and headers["x-source-topic"] == tp.topic.encode()
    assert headers["x-undecodable-cause"] == b"codec_unavailable"
    large = unreadable_record(settings, tp, 17, 21, "crc_mismatch", HOSTILE_MESSAGE, b"b" * (2 * FLOOR))
    assert record_size(large.key, large.value, large.headers) <= FLOOR
    headers = dict(large.headers)
    assert large.value == b"" and headers["x-value-omitted-bytes"] == str(2 * FLOOR).encode()
    assert headers["x-source-last-offset"] == b"21" and headers["x-undecodable-cause"] == b"crc_mismatch"
    unknown = unreadable_record(settings, tp, 17, 17, "crc_mismatch", "no batch", None)
    assert unknown.value == b"" and dict(unknown.headers)["x-source-last-offset"] == b"17"


@pytest.mark.parametrize("tier", ["default", "embedded"])
def test_the_producer_is_idempotent_where_the_broker_grants_producer_ids(
    tier: str, broker_pool: BrokerPool, tmp_path: Path
) -> None:
    """auto: Apache Kafka gives out producer ids, so results are sent idempotently; the embedded broker
    does not, so they are sent without (and still delivered)."""
    broker = broker_pool.broker(tier)
    names = Names.unique("idempotent")
    settings = fast_settings(broker.bootstrap, tmp_path, names, topic_partitions=1)
    assert settings.idempotence == "auto"

    async def scenario() -> bool | None:
        await ensure_topics(settings)
        publisher = Publisher(settings)
        await publisher.start()
        try:
            assert await publisher.deliver([_reply(settings, "only", settings.results_topic)]) == []
            assert publisher._started()._txn_manager is not None or not publisher.idempotent
        finally:
            await publisher.stop()
        return publisher.idempotent

    assert asyncio.run(scenario()) is (broker.name != "embedded")
    assert len(asyncio.run(read_topic(broker.bootstrap, settings.results_topic, 1, settle_s=0.2))) == 1
