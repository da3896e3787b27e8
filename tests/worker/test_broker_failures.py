"""Broker failures on a three-node Apache Kafka cluster, as a deployment meets them every week.

Replication factor 3 and `min.insync.replicas` 2 (the cluster's defaults for new and internal topics), the
worker's producer idempotent with acks=all (its `idempotence=auto` on a broker that grants producer ids).
For each failure, with a steady stream of requests running through one worker process:
- nothing is lost and nothing is answered twice (the worker itself never crashes here);
- the group's committed offsets, sampled all along and read at the end with Kafka's own
  `kafka-consumer-groups --describe`, are never past a request whose result was not yet published;
- the time to recover is measured (printed as FIGURES lines; docs/reliability.md keeps a table).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import netns
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from brokers import described_offsets, insisted, java_or_not_here
from fault_kit.accounting import Accounting, check_complete
from fault_kit.common import figures
from fault_kit.traffic import Stream, wait_until
from fault_kit.workers import Spawn, WorkerProcess, worker_env
from netns import Hosts
from worker_testkit import client_kwargs

from models import Scorer
from worker.apache_kafka import ApacheKafka, pom_versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RATE = 60.0  # requests per second
# Each stream runs until its failure is over and AFTER_S more, so that every failure below lands, and is
# recovered from, mid-stream however slowly a busy host recovers; CAP requests at most (5 minutes).
AFTER_S = 5.0
CAP = int(RATE * 300)
REPLICATION = 3


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts | None]:
    """A network namespace per node where this machine allows (root, iproute2): the cut-off test needs
    one; the other failures run on loopback without."""
    reason = netns.available()
    if reason is not None:
        if insisted():
            pytest.fail(f"the broker-failure tests run in CI as root with iproute2: {reason}")
        yield None
        return
    with Hosts(3) as made:
        yield made


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, hosts: Hosts | None) -> Iterator[ApacheKafka]:
    """Three combined-mode nodes of the newest Kafka, each on a host of its own where namespaces can be
    made; its files stay in pytest's temp dir for a failure to be read."""
    java_or_not_here()
    with ApacheKafka(
        nodes=3,
        version=pom_versions()["newest"],
        work_dir=tmp_path_factory.mktemp("kafka3"),
        hosts=hosts.addresses if hosts else None,
        wrappers=hosts.wrappers if hosts else None,
    ) as made:
        yield made


@dataclass
class CommitWatch:
    """Samples the group's committed offsets on the requests topic every 0.2 s (through a failure too:
    a sample the brokers cannot answer is counted, not fatal)."""

    bootstrap: str
    group: str
    topic: str
    samples: list[tuple[float, dict[int, int]]] = field(default_factory=list)
    unanswered: int = 0
    _task: asyncio.Task[None] | None = None

    async def start(self) -> CommitWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        admin = AIOKafkaAdminClient(**client_kwargs(self.bootstrap), request_timeout_ms=3000)
        await admin.start()
        try:
            while True:
                try:
                    offsets = await admin.list_consumer_group_offsets(self.group)
                    at = time.time()  # the commits it shows were made before now
                    self.samples.append(
                        (
                            at,
                            {
                                tp.partition: meta.offset
                                for tp, meta in offsets.items()
                                if tp.topic == self.topic
                            },
                        )
                    )
                except Exception:  # a broker down, a coordinator moving: the next sample will tell
                    self.unanswered += 1
                await asyncio.sleep(0.2)
        finally:
            await admin.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def placed_requests(stream: Stream) -> dict[tuple[int, int], str]:
    """(partition, offset) -> request id, from where the broker acknowledged each record."""
    placed = {}
    for request, where in zip(stream.requests, stream.producer.placed, strict=True):
        if where is not None:
            placed[where] = request.request_id
    return placed


def check_commits_behind_answers(samples: list[tuple[float, dict[int, int]]], stream: Stream) -> int:
    """Every sample: each request below a partition's committed offset had its result published before
    the sample was taken. Returns the number of samples checked."""
    placed = placed_requests(stream)
    first = stream.watcher.first
    for at, offsets in samples:
        for partition, committed in offsets.items():
            for offset in range(committed):
                request_id = placed.get((partition, offset))
                assert request_id is not None, (
                    f"committed {committed} on [{partition}] past what was produced"
                )
                published = first.get(request_id)
                assert published is not None and published <= at, (
                    f"committed offset {committed} of [{partition}] at {at:.3f} passes offset {offset} "
                    f"({request_id}), whose result was published at {published}"
                )
    return len(samples)


async def leader_of(bootstrap: str, topic: str, partition: int) -> int:
    admin = AIOKafkaAdminClient(**client_kwargs(bootstrap))
    await admin.start()
    try:
        for _ in range(50):
            described = await admin.describe_topics([topic])
            for part in described[0]["partitions"]:
                if part["partition"] == partition and part["leader"] >= 0:
                    return int(part["leader"])
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
    raise AssertionError(f"no leader for {topic}[{partition}]")


async def coordinator_of(bootstrap: str, group: str) -> int:
    admin = AIOKafkaAdminClient(**client_kwargs(bootstrap))
    await admin.start()
    try:
        return int(await admin.find_coordinator(group))
    finally:
        await admin.close()


async def fully_replicated(cluster: ApacheKafka, topics: list[str], timeout_s: float = 120.0) -> None:
    """Wait until every partition of `topics` (and of the group offsets) has all three replicas in sync:
    what a rolling restart waits for before taking the next node down."""
    admin = AIOKafkaAdminClient(**client_kwargs(cluster.bootstrap_servers))
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            described = await admin.describe_topics([*topics, "__consumer_offsets"])
            short = [
                (topic["topic"], part["partition"])
                for topic in described
                for part in topic["partitions"]
                if len(part["isr"]) < REPLICATION
            ]
            if not short:
                return
            assert time.monotonic() < deadline, f"partitions still under-replicated: {short[:5]}"
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


@dataclass
class Run:
    accounting: Accounting
    stream: Stream
    fault_at: float
    fault_done_at: float
    commits: CommitWatch
    tool_samples: list[tuple[float, dict[int, tuple[int, int]]]]

    def worst_wait_s(self) -> float:
        """The longest a request the broker acknowledged after the fault waited for its answer."""
        waits = [
            self.stream.watcher.first[request.request_id] - acked
            for request, acked in zip(self.stream.requests, self.stream.producer.acked_at, strict=True)
            if acked is not None
            and acked >= self.fault_at
            and request.request_id in self.stream.watcher.first
        ]
        return max(waits, default=0.0)

    def report(self, name: str, **values: object) -> None:
        """A FIGURES line: the failure's own `values`, then how the answers and the commits fared."""
        figures(
            name,
            **values,
            worst_wait_s=self.worst_wait_s(),
            longest_pause_s=self.longest_pause_s(),
            commit_samples=len(self.commits.samples),
            unanswered_commit_samples=self.commits.unanswered,
        )

    def longest_pause_s(self) -> float:
        """The longest time without a new answer while requests kept coming, from the fault on."""
        times = sorted(t for t in self.stream.watcher.first.values() if t >= self.fault_at)
        edges = [self.fault_at, *times]
        return max((b - a for a, b in itertools.pairwise(edges)), default=0.0)


async def run_with_fault(
    cluster: ApacheKafka,
    model_dir: Path,
    spawn: Spawn,
    name: str,
    fault: Callable[[Stream], Awaitable[None]],
    delivery: str = "at-least-once",
) -> Run:
    """One worker, a steady stream; `fault` runs once 300 requests are answered; the stream goes on
    AFTER_S more, then finishes. Exactly once, results are read with read_committed."""
    bootstrap = cluster.bootstrap_servers
    # The requests' producer is idempotent too: its retries through a failure must not write a request
    # twice (the worker would rightly answer both copies).
    isolation = "read_committed" if delivery == "exactly-once" else "read_uncommitted"
    stream = await Stream.open(
        bootstrap,
        name,
        CAP,
        RATE,
        replication=REPLICATION,
        idempotent=True,
        isolation_level=isolation,
        open_ended=True,
    )
    env = worker_env(bootstrap, model_dir, stream.names, delivery=delivery)
    commits = await CommitWatch(bootstrap, stream.names.group, stream.names.requests).start()
    try:
        worker: WorkerProcess = spawn("worker", env)
        await worker.wait_assigned(timeout_s=120)
        await stream.produce()
        await wait_until(lambda: len(stream.watcher.first) >= 300, 90, "300 answers")
        assert stream.running(), "the stream ended before the fault"
        fault_at = time.time()
        await fault(stream)
        fault_done_at = time.time()
        assert stream.running(), "the stream reached its cap before the fault was over"
        accounting = await stream.finish([worker], timeout_s=180, end_s=AFTER_S)
        # Everything answered: the commits catch up with the log's end, which Kafka's own tool then reports.
        log_end: dict[int, int] = {}
        for partition, offset in placed_requests(stream):
            log_end[partition] = max(log_end.get(partition, 0), offset + 1)
        await wait_until(
            lambda: bool(commits.samples) and commits.samples[-1][1] == log_end, 60, "the last commits"
        )
        tool_samples = [
            await asyncio.to_thread(described_offsets, cluster, stream.names.group, stream.names.requests)
        ]
        assert worker.running(), worker.tail()
        return Run(accounting, stream, fault_at, fault_done_at, commits, tool_samples)
    finally:
        await commits.stop()
        await stream.close()


def check_run(run: Run, reference: Scorer) -> None:
    check_complete(run.accounting, run.stream, reference)
    duplicates = run.accounting.duplicates
    assert duplicates == 0, f"{duplicates} requests answered twice without a worker crash"
    check_commits_behind_answers(run.commits.samples, run.stream)
    for at, rows in run.tool_samples:
        check_commits_behind_answers([(at, {p: current for p, (current, _) in rows.items()})], run.stream)
        assert all(current == end for current, end in rows.values()), f"kafka-consumer-groups: {rows}"


def survive(
    cluster: ApacheKafka,
    model_dir: Path,
    spawn: Spawn,
    reference: Scorer,
    name: str,
    fault: Callable[[Stream], Awaitable[None]],
    delivery: str = "at-least-once",
) -> Run:
    """run_with_fault, then the cluster made whole again for the next test, then the run checked."""
    try:
        run = asyncio.run(run_with_fault(cluster, model_dir, spawn, name, fault, delivery))
    finally:
        _all_nodes_up(cluster)
    check_run(run, reference)
    return run


def test_the_leader_of_a_partition_killed_mid_stream_then_restarted(
    cluster: ApacheKafka, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    killed: list[int] = []

    async def fault(stream: Stream) -> None:
        node = await leader_of(cluster.bootstrap_servers, stream.names.requests, 0)
        killed.append(node)
        cluster.kill(node)
        # Down until requests on the other leaders have flowed a while, then back (a crash and a restart).
        await asyncio.sleep(8)
        await asyncio.to_thread(cluster.restart, node)

    run = survive(cluster, tiny_llama_dir, spawn, reference, "leader", fault)
    run.report("leader kill -9", node=killed[0], restart_s=run.fault_done_at - run.fault_at - 8)


def test_exactly_once_through_a_kill_of_the_node_coordinating_its_transactions(
    cluster: ApacheKafka, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    """Exactly once (read back with read_committed): the node coordinating the transactions of requests
    partition 0 (and leading partitions of the topics) killed mid-stream, then restarted. The worker's
    transactions on it are aborted or time out and are written again through the new coordinator: each
    request answered once, the commits never past an answer."""
    killed: list[int] = []

    async def fault(stream: Stream) -> None:
        transactional_id = f"score-worker.{stream.names.group}.{stream.names.requests}.0"
        node = await transaction_coordinator_of(cluster.bootstrap_servers, transactional_id)
        killed.append(node)
        cluster.kill(node)
        await asyncio.sleep(8)
        await asyncio.to_thread(cluster.restart, node)

    run = survive(cluster, tiny_llama_dir, spawn, reference, "eos-txn", fault, delivery="exactly-once")
    run.report("exactly-once, transaction coordinator kill -9", node=killed[0])


async def transaction_coordinator_of(bootstrap: str, transactional_id: str) -> int:
    admin = AIOKafkaAdminClient(**client_kwargs(bootstrap))
    await admin.start()
    try:
        return int(await admin.find_coordinator(transactional_id, coordinator_type=1))
    finally:
        await admin.close()


def test_the_node_coordinating_the_group_killed_mid_stream(
    cluster: ApacheKafka, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    killed: list[int] = []
    moved_after: list[float] = []

    async def fault(stream: Stream) -> None:
        node = await coordinator_of(cluster.bootstrap_servers, stream.names.group)
        killed.append(node)
        cluster.kill(node)
        # The group's offsets partition gets a new leader, which becomes the coordinator; commits resume.
        moved_after.append(
            await _wait_for(lambda: coordinator_of(cluster.bootstrap_servers, stream.names.group), node)
        )
        await asyncio.sleep(5)  # running on the new coordinator a while, then the old node comes back
        await asyncio.to_thread(cluster.restart, node)

    run = survive(cluster, tiny_llama_dir, spawn, reference, "coordinator", fault)
    run.report("coordinator kill -9", node=killed[0], coordinator_moved_s=moved_after[0])


def test_a_rolling_restart_of_all_three_nodes(
    cluster: ApacheKafka, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    per_node: list[float] = []

    async def fault(stream: Stream) -> None:
        topics = [stream.names.requests, stream.names.results, stream.names.dlq]
        for node in sorted(cluster.nodes):
            started = time.monotonic()
            await asyncio.to_thread(cluster.terminate, node)  # SIGTERM: a controlled shutdown
            await asyncio.to_thread(cluster.restart, node)
            await fully_replicated(cluster, topics)
            per_node.append(time.monotonic() - started)

    # Three restarts, each waiting for every replica to catch up (10-14 s each here).
    run = survive(cluster, tiny_llama_dir, spawn, reference, "rolling", fault)
    run.report("rolling restart", per_node_s=" ".join(f"{s:.1f}" for s in per_node))


async def _wait_for(ask: Callable[[], Awaitable[int]], not_value: int, timeout_s: float = 60.0) -> float:
    """Seconds until `ask()` answers something other than `not_value`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(Exception):
            if await ask() != not_value:
                return time.monotonic() - started
        await asyncio.sleep(0.2)
    raise AssertionError(f"still {not_value} after {timeout_s} s")


def _all_nodes_up(cluster: ApacheKafka) -> None:
    """Leave the cluster whole for the next test, whatever this one did."""
    for node_id, node in cluster.nodes.items():
        if not node.running():
            cluster.restart(node_id)
    cluster.wait_ready()


def test_one_node_cut_off_from_the_network_then_back(
    cluster: ApacheKafka, hosts: Hosts | None, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    """The leader of a partition loses its network (no reset: its connections just go quiet) for 20 s: the
    others fence it and elect new leaders, clients time out on it and move; then it comes back and
    catches up."""
    if hosts is None:
        pytest.skip("needs a network namespace per node (root and iproute2)")
    cut: list[int] = []

    async def fault(stream: Stream) -> None:
        node = await leader_of(cluster.bootstrap_servers, stream.names.requests, 0)
        cut.append(node)
        hosts.cut(node - 1)
        try:
            await asyncio.sleep(20)
        finally:
            hosts.heal(node - 1)
        await fully_replicated(cluster, [stream.names.requests, stream.names.results, stream.names.dlq])

    run = survive(cluster, tiny_llama_dir, spawn, reference, "cutoff", fault)
    run.report("node cut off 20 s", node=cut[0], rejoined_s=run.fault_done_at - run.fault_at)
