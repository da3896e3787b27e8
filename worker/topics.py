"""The worker's topics: created when missing (requests, results, dead letters); their record limit read."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from worker.config import WorkerSettings
from worker.errors import WorkerError

log = logging.getLogger(__name__)


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int] | None:
    """The partition ids of `topic` in fresh cluster metadata; None where the topic does not exist.

    `consumer.partitions_for_topic()` answers only for topics its client already tracks (subscribed or
    assigned), and a consumer that is about to assign itself a topic tracks none: Kafka answers a metadata
    request for no topics with none. This asks the brokers for every topic instead.
    """
    cluster = await consumer._client.fetch_all_metadata()
    partitions: set[int] | None = cluster.partitions_for_topic(topic)
    return partitions


async def ensure_topics(settings: WorkerSettings) -> list[str]:
    """Create whichever of the three topics does not exist yet; returns the names it created."""
    wanted = [settings.requests_topic, settings.results_topic, settings.dlq_topic]
    created = await create_missing_topics(
        settings.kafka_client_kwargs(), wanted, settings.topic_partitions, settings.topic_replication_factor
    )
    if created:
        log.info("created topics %s with %d partitions", ", ".join(created), settings.topic_partitions)
    return created


async def create_missing_topics(
    client_kwargs: dict[str, Any], wanted: list[str], partitions: int, replication_factor: int
) -> list[str]:
    """Create those of `wanted` that do not exist yet; returns the names it created. Another client creating
    one at the same moment is fine; any other refusal raises WorkerError."""
    admin = AIOKafkaAdminClient(**client_kwargs)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [name for name in wanted if name not in existing]
        if not missing:
            return []
        new_topics = [
            NewTopic(name=name, num_partitions=partitions, replication_factor=replication_factor)
            for name in missing
        ]
        response = await admin.create_topics(new_topics)
    finally:
        await admin.close()
    created = []
    for topic_error in response.topic_errors:
        name, code = topic_error[0], topic_error[1]
        error_type = for_code(code)
        if code == 0 or error_type is TopicAlreadyExistsError:
            if code == 0:
                created.append(name)
            continue
        detail = topic_error[2] if len(topic_error) > 2 and topic_error[2] else error_type.__name__
        raise WorkerError(f"cannot create topic {name!r}: {detail} (Kafka error code {code})")
    return created


async def broker_record_limit(settings: WorkerSettings) -> int | None:
    """The smallest record limit the brokers report for the results and dead-letter topics
    (max.message.bytes), or None when they do not say (Tansu does not answer DescribeConfigs)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    wanted = {"max.message.bytes"}
    resources = [
        ConfigResource(ConfigResourceType.TOPIC, name, configs=dict.fromkeys(wanted))
        for name in (settings.results_topic, settings.dlq_topic)
    ]
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    try:
        await admin.start()
        async with asyncio.timeout(10):
            responses = await admin.describe_configs(resources)
    except Exception as exc:  # an old or partial Kafka implementation: the configured limit stands
        log.info("the brokers did not report their record limit (%r); using max_record_bytes", exc)
        return None
    finally:
        await admin.close()
    limits = []
    for response in responses:
        for resource in response.resources:
            error_code, entries = resource[0], resource[4]
            if error_code:
                continue
            limits += [int(entry[1]) for entry in entries if entry[0] in wanted and entry[1] is not None]
    return min(limits) if limits else None
