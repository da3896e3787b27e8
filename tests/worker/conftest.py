"""The broker fixture of the worker tests: an external broker, a Kafka container, or the embedded Tansu."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_kit import Spawn, WorkerProcess
from worker_testkit import LiveWorker, Names, fast_settings

from models import Scorer, ScorerConfig
from worker.app import ScoreWorker
from worker.broker import EmbeddedBroker
from worker.topics import ensure_topics

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


@pytest.fixture(scope="module")
def live_worker(  # a worker per test module that asks for it, on its own topics
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> Iterator[LiveWorker]:
    names = Names.unique("client")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names)
    asyncio.run(ensure_topics(settings))  # the client needs the results topic before the worker is up
    worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(worker.run())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, name="live-worker", daemon=True)
    thread.start()
    try:
        yield LiveWorker(kafka_bootstrap, names, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
    finally:
        worker.stop()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the worker did not stop"
    assert not errors, errors


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Scorer:
    """The in-process float32 scorer every worker result is checked against."""
    return Scorer(tiny_llama_dir, ScorerConfig(device="cpu", dtype="float32"))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Starts worker processes; whatever is still running at the end of the test is killed."""
    started: list[WorkerProcess] = []

    def start(name: str, env: dict[str, str]) -> WorkerProcess:
        started.append(WorkerProcess(name, env, tmp_path))
        return started[-1]

    yield start
    for process in started:
        process.close()
