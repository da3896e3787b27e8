"""Creates the worker's topics (requests, results, dead letters) when they are missing."""

from __future__ import annotations

import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from worker.config import WorkerSettings
from worker.errors import WorkerError

log = logging.getLogger(__name__)


async def ensure_topics(settings: WorkerSettings) -> list[str]:
    """Create whichever of the three topics does not exist yet; returns the names it created."""
    wanted = [settings.requests_topic, settings.results_topic, settings.dlq_topic]
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [name for name in wanted if name not in existing]
        if not missing:
            return []
        new_topics = [
            NewTopic(
                name=name,
                num_partitions=settings.topic_partitions,
                replication_factor=settings.topic_replication_factor,
            )
            for name in missing
        ]
        response = await admin.create_topics(new_topics)
    finally:
        await admin.close()
    created = []
    for topic_error in response.topic_errors:
        name, code = topic_error[0], topic_error[1]
        error_type = for_code(code)
        # Another worker starting at the same moment may have created it first: that is fine.
        if code == 0 or error_type is TopicAlreadyExistsError:
            if code == 0:
                created.append(name)
            continue
        detail = topic_error[2] if len(topic_error) > 2 and topic_error[2] else error_type.__name__
        raise WorkerError(f"cannot create topic {name!r}: {detail} (Kafka error code {code})")
    if created:
        log.info("created topics %s with %d partitions", ", ".join(created), settings.topic_partitions)
    return created
