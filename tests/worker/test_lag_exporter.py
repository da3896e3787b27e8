"""The lag exporter sees a group's lag from the brokers alone: no worker runs in these tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition
from brokers import OwnBroker
from prometheus_client.parser import text_string_to_metric_families
from worker_testkit import Names, client_kwargs, model_libraries_loaded_by, produce

from worker.lag_exporter import LagExporter

pytestmark = pytest.mark.slow


def _samples(exporter: LagExporter, name: str) -> dict[tuple[str, str, str], float]:
    from prometheus_client import generate_latest

    text = generate_latest(exporter.metrics.registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                labels = sample.labels
                found[(labels["group"], labels["topic"], labels["partition"])] = sample.value
    return found


async def _commit(bootstrap: str, group: str, offsets: dict[TopicPartition, int]) -> None:
    consumer = AIOKafkaConsumer(**client_kwargs(bootstrap), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit(offsets)
    finally:
        await consumer.stop()


def test_lag_is_read_from_the_brokers_without_any_worker(kafka_bootstrap: str) -> None:
    names = Names.unique("lag")
    missing = f"{names.requests}.never-created"

    async def scenario() -> None:
        admin = AIOKafkaAdminClient(**client_kwargs(kafka_bootstrap))
        await admin.start()
        await admin.create_topics([NewTopic(names.requests, 2, 1)])
        await admin.close()
        # 5 records to partition 0, 3 to partition 1 (explicit partitions: the counts are known).
        records = [(f"k{i}".encode(), b"v", []) for i in range(8)]
        await produce(kafka_bootstrap, names.requests, records)
        exporter = LagExporter(kafka_bootstrap, [names.group], [names.requests, missing], interval_s=0.2)
        await exporter.start()
        try:
            await exporter.poll()
            ends = {int(p): v for (_, _, p), v in _samples(exporter, "score_worker_group_lag").items()}
            assert sum(ends.values()) == 8  # nothing committed: the whole topic is behind
            await _commit(kafka_bootstrap, names.group, {TopicPartition(names.requests, 0): 1})
            await exporter.poll()
            lag = _samples(exporter, "score_worker_group_lag")
            assert lag[(names.group, names.requests, "0")] == ends[0] - 1
            assert lag[(names.group, names.requests, "1")] == ends[1]
            committed = _samples(exporter, "score_worker_group_committed_offset")
            assert committed[(names.group, names.requests, "0")] == 1
            await _commit(
                kafka_bootstrap, names.group,
                {TopicPartition(names.requests, p): int(end) for p, end in ends.items()},
            )  # fmt: skip
            await exporter.poll()
            assert set(_samples(exporter, "score_worker_group_lag").values()) == {0}
        finally:
            await exporter.stop()
        # Asking about a topic that does not exist must not create it.
        admin = AIOKafkaAdminClient(**client_kwargs(kafka_bootstrap))
        await admin.start()
        try:
            assert missing not in await admin.list_topics()
        finally:
            await admin.close()

    asyncio.run(scenario())


def test_a_broker_that_is_not_up_yet_means_failed_polls_until_it_is(
    own_broker: Callable[..., OwnBroker],
) -> None:
    """The exporter may start before Kafka (compose starts them together): it keeps trying, then reports."""
    from worker.broker import free_port

    port = free_port()
    names = Names.unique("late")

    async def scenario(started: asyncio.Event, up: asyncio.Event) -> LagExporter:
        exporter = LagExporter(f"127.0.0.1:{port}", [names.group], [names.requests], interval_s=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(exporter.run(stop))
        await asyncio.sleep(1.0)
        failures = exporter.metrics.registry.get_sample_value("score_worker_lag_exporter_poll_failures_total")
        assert not exporter.healthy and (failures or 0) >= 2
        started.set()
        # The broker's start-up takes as long as the host lets it (a loaded CI machine: tens of seconds),
        # so the wait for health begins once it answers: from then on one poll round (at most its 10 s
        # timeout, then 0.2 s apart) must succeed; 60 s leaves room for a failed round in progress.
        await up.wait()
        for _ in range(300):  # 60 s
            if exporter.healthy:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(task, 30)
        await exporter.stop()
        return exporter

    async def with_late_broker() -> LagExporter:
        started, up = asyncio.Event(), asyncio.Event()
        run = asyncio.create_task(scenario(started, up))
        await started.wait()
        await asyncio.to_thread(own_broker, port)
        up.set()
        return await run

    exporter = asyncio.run(with_late_broker())
    assert exporter.healthy


def test_the_exporter_and_the_supervisor_load_no_model_library() -> None:
    """The lag exporter and a host's supervisor score nothing: importing torch would cost each start
    seconds of CPU (and the lag exporter runs where no torch is installed). worker.metrics names the
    engine's types for annotations only."""
    assert model_libraries_loaded_by("worker.lag_exporter", "worker.supervisor") == []
