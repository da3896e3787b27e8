"""The broker fixture of the worker tests: an external broker, a Kafka container, or the embedded Tansu."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from worker.broker import EmbeddedBroker

log = logging.getLogger(__name__)


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
    except Exception:  # no client library, no socket, no daemon: all mean "no Docker here"
        return False
    return True


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap servers of a real broker for the whole session.

    SCORE_WORKER_TEST_BOOTSTRAP names an existing broker; otherwise a Kafka container when a Docker engine
    answers; otherwise the embedded Tansu broker (the usual case on the development and CI machines).
    """
    external = os.environ.get("SCORE_WORKER_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
        return
    with EmbeddedBroker() as broker:
        log.info("tests use the embedded broker at %s (log %s)", broker.bootstrap_servers, broker.log_path)
        yield broker.bootstrap_servers
