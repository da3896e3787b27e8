"""The brokers the worker tests run against, started once per session and shared by tier.

Tiers a test module can ask for (see `broker_tiers`):
- "default": what the whole suite runs on, chosen in this order: a broker named by
  $SCORE_WORKER_TEST_BOOTSTRAP; Apache Kafka (the pom's newest version) from its jars where Java is present;
  testcontainers' Kafka where a Docker engine answers; the embedded broker (Tansu).
  $SCORE_WORKER_TEST_BROKER=kafka|testcontainers|embedded insists on one (CI insists on kafka: a missing
  Java is then an error, not a quiet fallback), and $SCORE_WORKER_TEST_KAFKA_VERSION picks another version.
- "embedded": the embedded broker, the demo's path, kept true beside Kafka.
- "kafka-compose": Apache Kafka at the version docker-compose.yml runs, for the tests whose behaviour
  depends on the broker's version (protocol versions, group coordination, codecs).

A tier that would be the default broker again (no Java: "embedded" is the default) is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pytest

from worker.apache_kafka import ApacheKafka, KafkaUnavailable, find_java, pom_versions
from worker.broker import EmbeddedBroker

log = logging.getLogger(__name__)

TIERS = ("default", "embedded", "kafka-compose")


@dataclass
class TestBroker:
    """A started broker: where it is, what it is, and where its logs are."""

    __test__ = False  # not a test class

    name: str  # "apache-kafka-4.4.0", "embedded", "external", "testcontainers"
    bootstrap: str
    description: str
    log_tail: Callable[[], str]
    files: Path | None
    cluster: ApacheKafka | None = None  # for Kafka's own tools, where the broker is one the tests started
    uses: Counter[str] = field(default_factory=Counter)  # test module -> tests run on it
    failures: int = 0


class BrokerPool:
    """Starts each broker on first use and stops them all at the end of the session."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._by_name: dict[str, TestBroker] = {}
        self._tiers: dict[str, TestBroker | str] = {}  # tier -> broker, or why it cannot run here
        self.fallback_reason: str | None = None

    def broker(self, tier: str) -> TestBroker:
        """The broker of a tier; pytest.skip where the tier cannot run here or would repeat the default."""
        if tier not in TIERS:
            raise ValueError(f"unknown broker tier {tier!r}")
        if tier not in self._tiers:
            try:
                self._tiers[tier] = self._start(tier)
            except _NotHere as reason:
                self._tiers[tier] = str(reason)
        found = self._tiers[tier]
        if isinstance(found, str):
            pytest.skip(found)
        return found

    def embedded(self) -> TestBroker:
        """The embedded broker, whatever the default: for tests of bytes only a broker that does not
        validate batches stores (Apache Kafka refuses them at produce time)."""
        default = self.broker("default")
        return default if default.name == "embedded" else self.broker("embedded")

    def peek(self, tier: str) -> TestBroker | None:
        found = self._tiers.get(tier)
        return found if isinstance(found, TestBroker) else None

    def _start(self, tier: str) -> TestBroker:
        if tier == "default":
            return self._default()
        if tier == "embedded":
            if self.broker("default").name == "embedded":
                raise _NotHere("the default broker is the embedded one here: its tests ran there")
            return self._embedded()
        if not _java_here():
            raise _NotHere("Apache Kafka needs Java 17 or newer (apt-get install default-jre-headless)")
        version = pom_versions()["compose"]
        if self.broker("default").name == f"apache-kafka-{version}":
            raise _NotHere(f"the default broker is already Apache Kafka {version}")
        return self._apache_kafka(version)

    def _default(self) -> TestBroker:
        external = os.environ.get("SCORE_WORKER_TEST_BOOTSTRAP")
        if external:
            return self._register(
                TestBroker("external", external, f"the broker at {external}", lambda: "", None)
            )
        wanted = os.environ.get("SCORE_WORKER_TEST_BROKER", "")
        if wanted not in ("", "kafka", "testcontainers", "embedded"):
            raise pytest.UsageError(
                f"SCORE_WORKER_TEST_BROKER={wanted!r}: use kafka, testcontainers or embedded"
            )
        reasons = []
        if wanted in ("", "kafka"):
            version = os.environ.get("SCORE_WORKER_TEST_KAFKA_VERSION") or pom_versions()["newest"]
            try:
                return self._apache_kafka(pom_versions().get(version, version))
            except KafkaUnavailable as error:
                if wanted:
                    raise
                reasons.append(str(error))
        if wanted in ("", "testcontainers") and _docker_answers():
            from testcontainers.kafka import KafkaContainer

            container = self._stack.enter_context(KafkaContainer())
            return self._register(
                TestBroker("testcontainers", container.get_bootstrap_server(), "testcontainers' Kafka",
                           lambda: container.get_logs()[0].decode(errors="replace")[-4000:], None)
            )  # fmt: skip
        if wanted == "testcontainers":
            raise pytest.UsageError("SCORE_WORKER_TEST_BROKER=testcontainers but no Docker engine answers")
        self.fallback_reason = "; ".join(reasons) or None
        return self._embedded()

    def _apache_kafka(self, version: str) -> TestBroker:
        cluster = ApacheKafka(nodes=1, version=version)
        cluster.start()
        self._stack.callback(
            lambda: cluster.stop(keep_files=self._by_name[f"apache-kafka-{version}"].failures > 0)
        )
        return self._register(
            TestBroker(f"apache-kafka-{version}", cluster.bootstrap_servers, cluster.describe(),
                       lambda: cluster.log_tails(40), cluster.directory, cluster)
        )  # fmt: skip

    def _embedded(self) -> TestBroker:
        broker = EmbeddedBroker()
        broker.start()
        self._stack.callback(lambda: broker.stop(keep_log=self._by_name["embedded"].failures > 0))
        files = broker.log_path.parent if broker.log_path else None
        return self._register(
            TestBroker("embedded", broker.bootstrap_servers, "the embedded broker (Tansu, in memory)",
                       lambda: _tail(broker.log_path), files)
        )  # fmt: skip

    def _register(self, broker: TestBroker) -> TestBroker:
        self._by_name[broker.name] = broker
        log.warning("worker tests: %s at %s", broker.description, broker.bootstrap)
        return broker

    def started(self) -> list[TestBroker]:
        return list(self._by_name.values())

    def close(self) -> None:
        self._stack.close()


def described_offsets(
    cluster: ApacheKafka, group: str, topic: str
) -> tuple[float, dict[int, tuple[int, int]]]:
    """Kafka's `kafka-consumer-groups --describe`: when it answered, and per partition (CURRENT-OFFSET,
    LOG-END-OFFSET)."""
    done = cluster.run_tool(
        "kafka-consumer-groups",
        "--bootstrap-server",
        cluster.bootstrap_servers,
        "--describe",
        "--group",
        group,
    )
    at = time.time()
    rows: dict[int, tuple[int, int]] = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0] == group and fields[1] == topic:
            current = -1 if fields[3] == "-" else int(fields[3])
            rows[int(fields[2])] = (current, int(fields[4]))
    assert rows, f"kafka-consumer-groups described no partition of {topic}:\n{done.stdout}\n{done.stderr}"
    return at, rows


class _NotHere(Exception):
    pass


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return f"{path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def insisted() -> bool:
    """Whether the run insists on Apache Kafka (CI does): what the broker tests need must then be here."""
    return os.environ.get("SCORE_WORKER_TEST_BROKER") == "kafka"


def not_here(reason: str) -> NoReturn:
    """Skip a test for want of what `reason` names; fail it where the run insists on Apache Kafka."""
    if insisted():
        pytest.fail(f"{reason} (SCORE_WORKER_TEST_BROKER=kafka: every broker test runs)")
    pytest.skip(reason)


def java_or_not_here() -> str:
    """The Java launcher Apache Kafka runs with, or not_here()."""
    try:
        return find_java()
    except KafkaUnavailable as error:
        not_here(str(error))


def _java_here() -> bool:
    try:
        find_java()
    except KafkaUnavailable:
        return False
    return True


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
    except Exception:  # no client library, no socket, no daemon: all mean "no Docker here"
        return False
    return True


class OwnBroker(Protocol):
    """What a test that owns its broker uses: EmbeddedBroker and ApacheKafka both are one."""

    @property
    def bootstrap_servers(self) -> str: ...

    @property
    def listen_port(self) -> int: ...

    def stop(self) -> None: ...


def own_broker_of(
    pool: BrokerPool, port: int | None = None, advertised: tuple[str, int] | None = None
) -> OwnBroker:
    """A started broker of the default broker's kind, for one test that stops it or puts a proxy in front.

    Apache Kafka where the session runs on it (one node, on `port` when given, telling clients
    `advertised`), the embedded broker otherwise (an external broker or a container cannot be owned).
    """
    default = pool.broker("default")
    if default.name.startswith("apache-kafka-"):
        version = default.name.removeprefix("apache-kafka-")
        cluster = ApacheKafka(
            nodes=1,
            version=version,
            ports=[port] if port else None,
            advertised=[advertised] if advertised else None,
        )
        return cluster.start()
    return EmbeddedBroker(port=port, advertised=advertised).start()


def broker_tiers(*tiers: str) -> Any:
    """A module-scoped `kafka_bootstrap` that runs the module's tests once per tier:
    `kafka_bootstrap = broker_tiers("default", "kafka-compose")` in a test module."""
    for tier in tiers:
        if tier not in TIERS:
            raise ValueError(f"unknown broker tier {tier!r}")

    @pytest.fixture(scope="module", params=tiers)
    def kafka_bootstrap(request: pytest.FixtureRequest, broker_pool: BrokerPool) -> str:
        return broker_pool.broker(request.param).bootstrap

    return kafka_bootstrap
