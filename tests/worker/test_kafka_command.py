"""`score-worker kafka` for failure trials (worker/kafka_command.py): a node that stops is reported once and
the others keep running; SIGUSR1 starts the stopped nodes again; the command ends on a signal (0) or once
no node is left (1). The nodes here are stand-in processes: what is tested is the command's watch, not
Kafka (tests/worker/test_broker_failures.py kills real nodes under a worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from worker import kafka_command
from worker.apache_kafka import KafkaNode

pytestmark = pytest.mark.slow  # seconds of watching, at the command's pace

WAIT_S = 10.0  # the watch looks every POLL_S (0.5 s); a loaded machine's scheduling on top


class StandInCluster:
    """ApacheKafka's surface the watch uses, over `sleep` processes."""

    def __init__(self, size: int, directory: Path) -> None:
        self.size = size
        self.nodes = {
            i: KafkaNode(i, "127.0.0.1", 9000 + i, 9100 + i, directory / f"n{i}", ("127.0.0.1", 9000 + i))
            for i in range(1, size + 1)
        }
        for node in self.nodes.values():
            node.directory.mkdir(parents=True)
            node.log_path.write_text(f"node {node.node_id} started\nnode {node.node_id} last words\n")
            self._launch(node)
        self.restarted: list[int] = []

    def _launch(self, node: KafkaNode) -> None:
        node.process = subprocess.Popen(["sleep", "300"])

    def restart(self, node_id: int, wait: bool = True) -> None:
        self.restarted.append(node_id)
        self._launch(self.nodes[node_id])

    def kill(self, node_id: int) -> None:
        process = self.nodes[node_id].process
        assert process is not None
        process.kill()
        process.wait()

    def close(self) -> None:
        for node in self.nodes.values():
            if node.process is not None and node.process.poll() is None:
                node.process.kill()
                node.process.wait()


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    stand_in = StandInCluster(3, tmp_path)
    yield stand_in
    stand_in.close()


class Watching:
    """The command's watch on a thread, and what it wrote to stderr so far."""

    def __init__(
        self,
        cluster: StandInCluster,
        capsys: pytest.CaptureFixture[str],
        restart: threading.Event | None = None,
    ) -> None:
        self.stop, self.restart = threading.Event(), restart or threading.Event()
        self.code: list[int] = []
        self._capsys, self._seen = capsys, ""
        watched: Any = cluster  # what the watch uses of an ApacheKafka
        self.thread = threading.Thread(
            target=lambda: self.code.append(kafka_command.watch(watched, self.stop, self.restart))
        )
        self.thread.start()

    def errors(self) -> str:
        self._seen += self._capsys.readouterr().err
        return self._seen

    def end(self) -> list[int]:
        self.stop.set()
        self.thread.join(WAIT_S)
        return self.code


def test_a_stopped_node_is_reported_once_and_the_others_keep_running(
    cluster: StandInCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    watching = Watching(cluster, capsys)
    cluster.kill(2)
    _until(lambda: "node 2" in watching.errors(), "node 2 reported")
    time.sleep(3 * kafka_command.POLL_S)
    assert watching.thread.is_alive() and not watching.code, "the command ended while two nodes serve"
    assert cluster.nodes[1].running() and cluster.nodes[3].running()
    assert watching.errors().count("node 2 (") == 1, "a stopped node is reported once"
    assert watching.end() == [0]


def test_the_report_says_what_stopped_and_how_to_start_it_again(
    cluster: StandInCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    watching = Watching(cluster, capsys)
    cluster.kill(3)
    _until(lambda: "USR1" in watching.errors(), "the report")
    report = watching.errors()
    assert "node 3 (127.0.0.1:9003) exited with code -9; 2 of 3 nodes still serve" in report
    assert "node 3 last words" in report and f"kill -USR1 {os.getpid()}" in report
    assert watching.end() == [0]


def test_sigusr1_starts_the_stopped_nodes_again(
    cluster: StandInCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with kafka_command.restart_requests() as restart:
        watching = Watching(cluster, capsys, restart)
        cluster.kill(1)
        _until(lambda: "node 1 (" in watching.errors(), "node 1 reported")
        os.kill(os.getpid(), signal.SIGUSR1)
        _until(lambda: cluster.restarted == [1], "node 1 started again")
        assert cluster.nodes[1].running()
        assert watching.end() == [0]
    assert "node 1 started again" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGUSR1) == before, "the previous handler is back"


def test_the_command_ends_once_no_node_is_left(
    cluster: StandInCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    watching = Watching(cluster, capsys)
    for node_id in (1, 2, 3):
        cluster.kill(node_id)
    watching.thread.join(WAIT_S)
    assert watching.code == [1]
    assert "every node has stopped" in watching.errors()
