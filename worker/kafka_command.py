"""`score-worker kafka`: Apache Kafka (worker/apache_kafka.py) in the foreground for trials. A cluster of
several nodes is for failure trials: a node that dies is reported and the others keep serving; SIGUSR1
starts the stopped nodes again; the command ends on Ctrl-C or SIGTERM, or once every node has stopped."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from worker.apache_kafka import (
    ApacheKafka,
    class_archive,
    find_java,
    pom_versions,
    repository_pom,
    resolve_jars,
)
from worker.broker import until_signalled
from worker.config import read_environment
from worker.environment import KafkaEnvironment
from worker.errors import BrokerError

POLL_S = 0.5  # how often the nodes are looked at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `score-worker kafka`."""
    parser.add_argument(
        "--nodes", type=int, default=1, help="combined-mode nodes (default 1; 3 for failure trials)"
    )
    parser.add_argument(
        "--version", default=None, help="Kafka version (default: the pom's newest; 'compose' for compose's)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="cluster directory, kept (default: a temp dir)"
    )
    parser.add_argument(
        "--resolve-only",
        action="store_true",
        help="resolve the jars (of every version the pom names), record their class archives and exit",
    )


def run(args: argparse.Namespace) -> int:
    """Apache Kafka in the foreground until SIGINT/SIGTERM, or until no node is left."""
    environment = read_environment(KafkaEnvironment, "kafka")
    try:
        versions = pom_versions(repository_pom(environment))
        if args.resolve_only:
            java = find_java(environment)
            for each in dict.fromkeys(versions.values()):
                libs = resolve_jars(each, environment=environment)
                archive = class_archive(each, java, libs, environment)
                print(f"Kafka {each}: {libs}" + (f", classes {archive.name}" if archive else ""), flush=True)
            return 0
        version: str | None = versions.get(args.version, args.version) if args.version else None
        cluster = ApacheKafka(nodes=args.nodes, version=version, work_dir=args.dir, environment=environment)
        with until_signalled() as stop, restart_requests() as restart, cluster:
            _announce(cluster)
            return watch(cluster, stop, restart)
    except BrokerError as error:
        print(f"score-worker kafka: {error}", file=sys.stderr)
        return 1


def _announce(cluster: ApacheKafka) -> None:
    print(f"{cluster.describe()} on {cluster.bootstrap_servers}", flush=True)
    print(f"  files and logs in {cluster.directory}", flush=True)
    for node in cluster.nodes.values():
        pid = node.process.pid if node.process else "-"
        print(f"  node {node.node_id}: {node.address}, pid {pid}", flush=True)
    print(f"  score-worker run --model DIR --bootstrap-servers {cluster.bootstrap_servers}", flush=True)
    if cluster.size > 1:
        print(
            f"kill a node's pid for a failure trial; kill -USR1 {os.getpid()} starts the stopped nodes again",
            flush=True,
        )
    print("stop with Ctrl-C", flush=True)


@contextlib.contextmanager
def restart_requests() -> Iterator[threading.Event]:
    """An event that SIGUSR1 sets while inside: restart the stopped nodes. The previous handler comes back."""
    asked = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: asked.set())
    try:
        yield asked
    finally:
        signal.signal(signal.SIGUSR1, previous)


def watch(cluster: ApacheKafka, stop: threading.Event, restart: threading.Event) -> int:
    """Report each node that stops, once, and keep the others serving; start the stopped nodes again when
    `restart` is set. 0 once `stop` is set, 1 when every node has stopped."""
    reported: set[int] = set()
    while not stop.wait(POLL_S):
        if restart.is_set():
            restart.clear()
            for node_id in sorted(reported):
                cluster.restart(node_id, wait=False)
                node = cluster.nodes[node_id]
                pid = node.process.pid if node.process else "-"
                print(f"score-worker kafka: node {node_id} started again, pid {pid}", flush=True)
            reported.clear()
        stopped = [node for node in cluster.nodes.values() if not node.running()]
        for node in stopped:
            if node.node_id in reported:
                continue
            reported.add(node.node_id)
            code = node.process.returncode if node.process else None
            left = cluster.size - len(stopped)
            print(
                f"score-worker kafka: node {node.node_id} ({node.address}) exited with code {code}; "
                f"{left} of {cluster.size} nodes still serve\n{node.log_tail(10)}",
                file=sys.stderr,
                flush=True,
            )
            if left:
                print(f"  kill -USR1 {os.getpid()} starts it again on its ports and data", file=sys.stderr)
        if len(stopped) == cluster.size:
            print("score-worker kafka: every node has stopped", file=sys.stderr)
            return 1
    return 0
