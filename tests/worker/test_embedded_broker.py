"""EmbeddedBroker (Tansu) and topic creation: start, metadata, stop, clear errors, idempotent topics."""

from __future__ import annotations

import asyncio
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from worker_testkit import Names

from worker.broker import EmbeddedBroker, free_port, metadata_brokers
from worker.config import WorkerSettings
from worker.errors import BrokerBinaryNotFound, BrokerError
from worker.topics import ensure_topics


def test_starts_answers_metadata_and_stops(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_dir=tmp_path)
    with pytest.raises(BrokerError, match="not running"):
        _ = broker.bootstrap_servers
    with broker:
        host, port = broker.bootstrap_servers.split(":")
        assert metadata_brokers(host, int(port)) == [(host, int(port))]
        assert broker.log_path is not None and broker.log_path.parent == tmp_path
    with pytest.raises(OSError):
        metadata_brokers(host, int(port), timeout_s=0.5)
    broker.stop()  # idempotent


def test_a_log_directory_that_does_not_exist_yet_is_created(tmp_path: Path) -> None:
    with EmbeddedBroker(log_dir=tmp_path / "logs" / "tansu") as broker:
        assert broker.log_path is not None and broker.log_path.parent == tmp_path / "logs" / "tansu"
    assert (tmp_path / "logs" / "tansu" / "tansu.log").is_file()
    occupied = tmp_path / "a-file"
    occupied.write_text("")
    with pytest.raises(BrokerError, match="cannot create the broker's log directory"):
        EmbeddedBroker(log_dir=occupied / "logs").start()


def test_a_clean_stop_removes_the_log_directory_it_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with EmbeddedBroker() as broker:
        assert broker.log_path is not None
        made = broker.log_path.parent
        assert made.parent == tmp_path and made.name.startswith("score-worker-tansu-")
        assert broker.log_path.is_file()
    assert not made.exists() and broker.log_path is None
    with broker:  # started again: a new directory, removed again
        assert broker.log_path is not None and broker.log_path.parent != made
    assert list(tmp_path.iterdir()) == []


def test_a_broker_that_exited_on_its_own_keeps_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    broker = EmbeddedBroker().start()
    log_path = broker.log_path
    assert log_path is not None and broker._process is not None
    broker._process.send_signal(signal.SIGKILL)
    broker._process.wait(timeout=10)
    assert broker.exited()
    broker.stop()
    assert broker.log_path == log_path and log_path.is_file()


def test_a_broker_that_fails_to_start_keeps_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'no memory for you' >&2\nexit 4\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CALF_TANSU_BIN", str(fake))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(BrokerError, match=r"(?s)exited with code 4.*no memory for you"):
        EmbeddedBroker().start()
    (made,) = temp.iterdir()
    assert "no memory for you" in (made / "tansu.log").read_text()


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    not_executable = tmp_path / "tansu"
    not_executable.write_text("")
    monkeypatch.setenv("CALF_TANSU_BIN", str(not_executable))
    with pytest.raises(BrokerBinaryNotFound, match="CALF_TANSU_BIN"):
        EmbeddedBroker().start()


def test_a_binary_that_exits_reports_its_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'cannot bind: address in use' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CALF_TANSU_BIN", str(fake))
    with pytest.raises(BrokerError, match=r"(?s)exited with code 3.*address in use"):
        EmbeddedBroker(log_dir=tmp_path).start()


def test_ensure_topics_creates_missing_ones_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    names = Names.unique("topics")
    settings = WorkerSettings(
        bootstrap_servers=kafka_bootstrap,
        model_dir=tmp_path,
        requests_topic=names.requests,
        results_topic=names.results,
        dlq_topic=names.dlq,
        topic_partitions=2,
    )
    assert sorted(asyncio.run(ensure_topics(settings))) == sorted([names.requests, names.results, names.dlq])
    assert asyncio.run(ensure_topics(settings)) == []


def test_broker_command_serves_until_sigterm(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "worker", "broker", "--port", str(port), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # printed once the broker answers metadata
        assert f"127.0.0.1:{port}" in first, first
        assert metadata_brokers("127.0.0.1", port) == [("127.0.0.1", port)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    with pytest.raises(OSError):  # the broker went with the command
        metadata_brokers("127.0.0.1", port, timeout_s=0.5)
