"""The Apache Kafka launcher: jars resolved once, KRaft nodes that start, stop, crash and come back."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest
import raw_batches
from aiokafka.structs import TopicPartition
from brokers import BrokerPool, java_or_not_here
from worker_testkit import Record, produce, read_topic

from worker.apache_kafka import (
    SERVER_JVM,
    ApacheKafka,
    KafkaUnavailable,
    class_archive,
    find_java,
    java_version,
    pom_versions,
    resolve_jars,
)
from worker.broker import metadata_brokers
from worker.topics import create_missing_topics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def java() -> str:
    """Java for the broker; without it these tests skip, unless the run insists on Apache Kafka (CI)."""
    return java_or_not_here()


def _fake_java(directory: Path, banner: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "java"
    script.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_java_versions_are_read_from_both_banner_styles(tmp_path: Path) -> None:
    assert java_version(str(_fake_java(tmp_path / "a", 'openjdk version "17.0.15" 2025-04-15'))) == 17
    assert java_version(str(_fake_java(tmp_path / "b", 'openjdk version "25" 2025-09-16'))) == 25
    assert java_version(str(_fake_java(tmp_path / "c", 'java version "1.8.0_392"'))) == 8
    assert java_version(str(tmp_path / "absent")) is None


def test_an_old_java_is_refused_with_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _fake_java(tmp_path / "jdk11" / "bin", 'openjdk version "11.0.2" 2019-01-15')
    monkeypatch.setenv("JAVA_HOME", str(old.parent.parent))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KafkaUnavailable, match=r"Java 17 or newer.*version 11"):
        find_java()


def test_a_resolved_version_needs_no_maven_again(monkeypatch: pytest.MonkeyPatch) -> None:
    version = pom_versions()["newest"]
    first = resolve_jars(version)
    monkeypatch.setenv("PATH", "/nonexistent")  # no mvn to be found: the cache must answer
    assert resolve_jars(version) == first
    assert any(first.glob("kafka_2.13-*.jar")) and any(first.glob("kafka-clients-*.jar"))


def test_a_missing_version_without_maven_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCORE_WORKER_KAFKA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(KafkaUnavailable, match="needs Maven"):
        resolve_jars(pom_versions()["newest"])


@pytest.mark.parametrize("which", ["newest", "compose"])
def test_a_node_keeps_acknowledged_records_through_a_kill_and_a_restart(which: str, tmp_path: Path) -> None:
    version = pom_versions()[which]
    with ApacheKafka(nodes=1, version=version, work_dir=tmp_path / "cluster") as cluster:
        host, port = cluster.bootstrap_servers.split(":")
        assert metadata_brokers(host, int(port)) == [(host, int(port))]
        records: list[Record] = [(f"k{i}".encode(), f"v{i}".encode(), []) for i in range(20)]
        asyncio.run(produce(cluster.bootstrap_servers, "kept", records))
        cluster.kill(1)  # SIGKILL: no controlled shutdown, no flush beyond what acks=all implied
        assert not cluster.nodes[1].running()
        cluster.restart(1)
        read = asyncio.run(read_topic(cluster.bootstrap_servers, "kept", len(records), settle_s=0.2))
        assert sorted(r.value for r in read) == sorted(v for _, v, _ in records)
        log = cluster.nodes[1].log_path.read_text()
        assert f"Kafka version: {version}" in log  # the jars that ran are the version asked for
    # A directory given by the caller is kept, with each node's configuration and log.
    assert (tmp_path / "cluster" / "node-1" / "server.properties").exists()
    assert (tmp_path / "cluster" / "node-1" / "server.log").stat().st_size > 0


def _mapped_archives(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if ".jsa" in line}


def test_every_node_maps_the_class_archive_of_its_version_and_java(tmp_path: Path) -> None:
    """A node's JVM maps the class archive recorded for its version and Java (beside the jars, once: its
    classes parsed and verified then, not at every node's start), with either set of JVM options; a cache
    without one records it at the first start."""
    version = pom_versions()["newest"]
    java, libs = find_java(), resolve_jars(version)
    archive = class_archive(version, java, libs)
    assert archive is not None and archive.parent == libs.parent and archive.stat().st_size > 0
    for jvm in ({}, {"jvm": SERVER_JVM}):
        with ApacheKafka(nodes=1, version=version, **jvm) as cluster:  # type: ignore[arg-type]
            node = cluster.nodes[1]
            assert node.process is not None
            assert str(archive) in _mapped_archives(node.process.pid)
    # A cache of the jars without an archive (a new version, a cleared cache): recorded at the first use,
    # beside them, under the name of the same Java and jars.
    cache = tmp_path / "cache" / version
    cache.mkdir(parents=True)
    (cache / "libs").symlink_to(libs, target_is_directory=True)
    (cache / "resolved").write_text((libs.parent / "resolved").read_text())
    recorded = class_archive(version, java, cache / "libs")
    assert recorded is not None and recorded.parent == cache and recorded.name == archive.name
    assert recorded.stat().st_size > 0


def test_a_temporary_cluster_directory_goes_on_a_clean_stop() -> None:
    cluster = ApacheKafka(nodes=1).start()
    directory = cluster.directory
    assert (directory / "node-1" / "server.log").exists()
    cluster.stop()
    assert not directory.exists()


@pytest.mark.parametrize("damage", ["crc_damaged", "payload_cut", "record_damaged", "record_missing"])
def test_kafka_refuses_a_damaged_batch_at_produce_time(damage: str, broker_pool: BrokerPool) -> None:
    """Apache Kafka validates what it is given (CRC, decompression, record framing) and refuses a damaged
    batch: CORRUPT_MESSAGE (2) or INVALID_RECORD (87), and UNKNOWN_SERVER_ERROR (-1) for a gzip stream cut
    short. A damaged batch reaches a reader from Kafka only through damage at rest; the readers' tests of
    such bytes use the embedded broker, which stores them as given."""
    broker = broker_pool.broker("default")
    if broker.cluster is None:
        pytest.skip(f"the default broker is {broker.description}")
    topic = f"damaged-{damage}"
    asyncio.run(create_missing_topics({"bootstrap_servers": broker.bootstrap}, [topic], 1, 1))
    records: list[Record] = [(f"k{i}".encode(), f"value {i}".encode() * 20, []) for i in range(3)]
    batch = getattr(raw_batches, damage)(records)
    code, _ = asyncio.run(raw_batches.produce_raw_answer(broker.bootstrap, TopicPartition(topic, 0), batch))
    assert code in (2, 87, -1), code
    intact, _ = asyncio.run(
        raw_batches.produce_raw_answer(
            broker.bootstrap, TopicPartition(topic, 0), bytes(raw_batches.build(records))
        )
    )
    assert intact == 0
